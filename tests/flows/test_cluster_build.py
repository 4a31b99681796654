"""build-latents over a Ray cluster (flows/execution/cluster.py), as users run it: `sdpipe
build-latents web --cluster ADDRESS` in a fresh process, on a local multi-node Ray cluster (3 worker
nodes of 2 CPUs, tests/ray_cluster.py), for the LAION-kind source of test_laion_kind (no scorer, two
metadata files, awkward images, served on loopback), in shards of 4.

- Every per-shard stage's shards ran on at least 2 nodes, and the outputs equal a one-node
  run's, byte for byte (latents, tars) and row for row (tables).
- A node killed in the middle of fetch-images: the run completes, the lost node's shards are
  done again elsewhere, no finished shard is redone, the outputs are the same.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli import local
from flows.cli.status import status
from tasks.runtime.shards import read_stats
from tests.flows.test_laion_kind import upstream, write_catalog
from tests.tasks.conftest import loopback_server

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

PER_SHARD_STAGES = ("metadata", "shards", "tokens", "latents")
OUTPUT_STAGES = ("metadata", "filtered", "shards", "selected", "tokens", "latents")


class Mirror:
    """The test's image host: files of a folder, each image request held `delay_s` (the kill
    test slows fetch down so a node dies with shards in flight)."""

    def __init__(self, folder: Path):
        self.folder, self.delay_s = folder, 0.0

    def handler(self):
        mirror = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(mirror.folder), **kwargs)

            def do_GET(self):
                if "/img/" in self.path and mirror.delay_s:
                    time.sleep(mirror.delay_s)
                super().do_GET()

            def log_message(self, *args):
                pass

        return Handler


@pytest.fixture(scope="module")
def web(tmp_path_factory, small_catalog):
    """(folder, catalog, mirror): the LAION-kind source `web`, 4 samples per shard."""
    folder = tmp_path_factory.mktemp("cluster-web")
    mirror = Mirror(folder / "mirror")
    mirror.folder.mkdir()
    with loopback_server(mirror.handler(), request_queue_size=128) as url:
        upstream(mirror.folder, url)
        catalog = write_catalog(folder, small_catalog, mirror.folder / "metadata")
        sources = yaml.safe_load((catalog / "sources.yaml").read_text())
        sources["web"]["samples_per_shard"] = 4
        (catalog / "sources.yaml").write_text(yaml.safe_dump(sources))
        yield folder, catalog, mirror


def build(root: Path, catalog: Path, port: int, *args: str, wait: bool = True, **settings):
    env = {
        **os.environ,
        **settings,
        "SDPIPE_CATALOG": str(catalog),
        "SDPIPE_DATA": str(root),
        "PREFECT_API_URL": local.api_url(port),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    script = Path(sys.executable).with_name("sdpipe")
    command = [str(script), "build-latents", "web", *args]
    if not wait:
        return subprocess.Popen(
            command, cwd=root.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    return subprocess.run(
        command, cwd=root.parent, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def one_node(web, prefect_stack) -> Path:
    """The same source built without a cluster: the reference."""
    folder, catalog, _ = web
    root = folder / "one-node" / "data"
    root.parent.mkdir()
    done = build(root, catalog, prefect_stack[1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


def outputs(root: Path) -> dict[str, object]:
    """Every output of the stages: tables by their rows, latents by their bytes, tars by their
    images (stats records, which hold times and nodes, and hidden files are not outputs)."""
    out: dict[str, object] = {}
    for stage in OUTPUT_STAGES:
        for path in sorted((root / "web" / stage).iterdir()):
            name = f"{stage}/{path.name}"
            if path.name.startswith(".") or path.name.endswith((".stats.json", ".html")):
                continue
            if path.suffix == ".parquet":
                out[name] = pq.read_table(path).to_pylist()
            elif path.suffix == ".tar":  # its images, by key: their order is the order
                with tarfile.open(path) as tar:  # the download's pieces finished in
                    out[name] = {m.name: tar.extractfile(m).read() for m in tar}
            elif path.suffix == ".npy":
                out[name] = path.read_bytes()
    return out


def nodes_of(root: Path, stage: str) -> dict[str, str]:
    return {r.shard: r.node for r in read_stats(root, "web", stage)}


def wait_for(proc, output: list[bytes], found, deadline: float):
    """The first event `found()` returns while the build runs (polled every 0.1 s)."""
    while time.monotonic() < deadline and proc.poll() is None:
        if (event := found()) is not None:
            return event
        time.sleep(0.1)
    raise AssertionError(b"".join(output)[-3000:].decode(errors="replace"))


def journal(root: Path, stage: str) -> list[dict]:
    """The stage's progress journal: its shards' start and done events, in order (a last line
    being written is left for the next read)."""
    path = root / ".progress" / "web" / f"{stage}.jsonl"
    if not path.exists():
        return []
    return [
        json.loads(line)
        for line in path.read_text().splitlines(keepends=True)
        if line.endswith("\n")
    ]


def test_build_latents_runs_on_three_nodes_and_equals_a_one_node_run(
    web, one_node, cluster, prefect_stack
):
    folder, catalog, _ = web
    root = folder / "three-nodes" / "data"
    root.parent.mkdir()
    done = build(root, catalog, prefect_stack[1], "--cluster", cluster.address)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    for stage in PER_SHARD_STAGES:
        nodes = nodes_of(root, stage)
        assert len(nodes) >= 2, (stage, nodes)
        assert len(set(nodes.values())) >= 2, (stage, nodes)
    # Global stages' records are written in the flow's process, on this machine; on a cluster
    # (SDPIPE_PARTITIONED=auto) the metadata filter ran as partition tasks on its nodes.
    (filtered,) = read_stats(root, "web", "filtered")
    assert filtered.node == os.uname().nodename
    assert filtered.extra["partitioned"]["tasks"] > 0
    assert {e["node"] for e in journal(root, "partitions") if e["event"] == "start"} - {
        os.uname().nodename
    }
    # `sdpipe status` says which node did each shard.
    report = {s["stage"]: s for s in status(root)["sources"]["web"]}
    fetch = report["fetch-images"]["nodes"]
    assert len(fetch) >= 2 and sorted(sum(fetch.values(), [])) == sorted(nodes_of(root, "shards"))

    mine, reference = outputs(root), outputs(one_node)
    assert sorted(mine) == sorted(reference)
    assert [n for n in mine if mine[n] != reference[n]] == []
    assert any(n.endswith(".npy") for n in mine) and any(n.endswith(".tar") for n in mine)


def first_start(root: Path, stage: str, task: str | None = None):
    """The node of the stage's first unit started (of partition task `task`), else None."""
    starts = [
        e
        for e in journal(root, stage)
        if e["event"] == "start" and (task is None or e.get("task") == task)
    ]
    return starts[0]["node"] if starts else None


def test_a_node_lost_mid_filter_and_one_mid_fetch_cost_only_their_work(
    web, one_node, cluster, prefect_stack
):
    """One node is lost while the partitioned filter's keys tasks run (each held a second by
    the test seam SDPIPE_TEST_PARTITION_DELAY; a small task memory makes many of them), another
    while fetch-images runs: each costs only its own tasks and shards."""
    folder, catalog, mirror = web
    root = folder / "lost-node" / "data"
    root.parent.mkdir()
    names = {node_id[:6]: node_id for node_id in cluster.node_ids()}  # record name -> Ray id
    mirror.delay_s = 1.0  # a shard's fetch takes seconds: the node dies with shards in flight
    settings = {"SDPIPE_TEST_PARTITION_DELAY": "keys:1", "SDPIPE_FILTER_TASK_MEMORY": "2000"}
    proc = build(
        root, catalog, prefect_stack[1], "--cluster", cluster.address, wait=False, **settings
    )
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        lost = wait_for(
            proc, output, lambda: first_start(root, "partitions", "filter-keys"), deadline
        )
        cluster.kill(names[lost.rsplit("-", 1)[1]])
        lost_tasks = len(journal(root, "partitions"))
        victim = wait_for(proc, output, lambda: first_start(root, "shards"), deadline)
        cluster.kill(names[victim.rsplit("-", 1)[1]])
        lost_events = len(journal(root, "shards"))
        mirror.delay_s = 0.0
        assert proc.wait(timeout=600) == 0, b"".join(output)[-4000:].decode(errors="replace")
    finally:
        mirror.delay_s = 0.0
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    log = b"".join(output).decode(errors="replace")
    assert f"node {victim} lost" in log or victim in log, log[-3000:]

    # The filter: the lost node's keys tasks in flight ran again on another node; no task that
    # finished ran again.
    tasks = journal(root, "partitions")
    before, after = tasks[:lost_tasks], tasks[lost_tasks:]
    done_before = {(e["task"], e["shard"]) for e in before if e["event"] == "done"}
    in_flight = {
        (e["task"], e["shard"]) for e in before if e["event"] == "start" and e["node"] == lost
    }
    in_flight = {t for t in in_flight - done_before if t[0] == "filter-keys"}
    assert in_flight, (lost, before)
    started_after = [(e["task"], e["shard"], e["node"]) for e in after if e["event"] == "start"]
    assert not done_before & {(t, s) for t, s, _ in started_after}
    for task in in_flight:
        assert [n for t, s, n in started_after if (t, s) == task and n != lost], task
    (filtered,) = read_stats(root, "web", "filtered")
    assert filtered.extra["partitioned"]["partitions"] > 2

    events = journal(root, "shards")
    before, after = events[:lost_events], events[lost_events:]
    done_before = {e["shard"] for e in before if e["event"] == "done"}
    in_flight = {e["shard"] for e in before if e["event"] == "start" and e["node"] == victim}
    in_flight -= done_before
    assert in_flight, (victim, before)  # the node died with work in hand
    # Each shard done once: nothing finished is redone; the lost node's shards are done again
    # on the other nodes.
    dones = [e["shard"] for e in events if e["event"] == "done"]
    assert sorted(dones) == sorted(set(dones)) == sorted(nodes_of(root, "shards"))
    assert not done_before & {e["shard"] for e in after if e["event"] == "start"}
    for shard in in_flight:
        assert nodes_of(root, "shards")[shard] != victim
    mine, reference = outputs(root), outputs(one_node)
    assert sorted(mine) == sorted(reference)
    assert [n for n in mine if mine[n] != reference[n]] == []
