"""build-latents with the partitioned global stages (flows/execution/partitioned.py) on the demo
source, its profile given a pHash and a semantic level: the metadata filter and filter-pixels'
pHash and semantic dedup as partition tasks (SDPIPE_PARTITIONED=always) write the same filtered
shards, selection and counts as the one-node stages (never). A partition task that fails fails
the flow naming it, and the rerun runs only that partition and those after it (the finished ones
are reused from their folders).

One pair of builds serves every test (module fixture): the one-node build, and the partitioned
build, which fails in the filter, then in filter-pixels' pHash, then completes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from catalog.copies import edit_entries
from tasks.curation import filter_partitioned, phash_partitioned, semantic_partitioned
from tasks.runtime.shards import read_stats
from tests.conftest import write_small_catalog

pytestmark = pytest.mark.slow

FAILING_KEYS = 1  # the filter's keys partition that fails on its first attempt
FAILING_NODES = 1  # the pHash nodes partition (of the run over every row) that fails once
PHASH_DISTANCE = 12  # wide enough on the demo's images for chains and drops among the kept
# The tiny scorer's random embeddings of the demo's images are all within ~0.99 of each other:
# at this threshold ~1 row in 6 has a better duplicate.
SEMANTIC_THRESHOLD = 0.9995


def _build(root: Path):
    from prefect.logging.handlers import APILogWorker

    from flows.build_latents import build_latents

    state = build_latents(source="demo", data_root=str(root), workers=2, return_state=True)
    APILogWorker.drain_all()
    return state


def _tables(folder: Path) -> dict[str, list]:
    """Each shard's rows, the demo mirror's port (a build's own) left out of its URLs."""
    return {
        p.name: [
            row | ({"url": re.sub(r":\d+/", ":PORT/", row["url"])} if row.get("url") else {})
            for row in pq.read_table(p).to_pylist()
        ]
        for p in sorted(folder.glob("[0-9]*.parquet"))
    }


@dataclass
class Builds:
    one_node: Path
    parted: Path
    messages: list[str] = field(default_factory=list)  # of the failed partitioned runs
    keys_rerun: list[int] = field(default_factory=list)  # keys partitions the 2nd run ran
    nodes_rerun: list[tuple] = field(default_factory=list)  # (plan, bucket) the 3rd run ran


@pytest.fixture(scope="module")
def builds(prefect_stack, tmp_path_factory) -> Builds:
    base = tmp_path_factory.mktemp("partitioned-build")
    catalog = write_small_catalog(base / "catalog")
    with edit_entries(catalog / "profiles.yaml") as profiles:
        profiles["demo"]["dedup"] = ["url", "sha256", "phash", "semantic"]
        profiles["demo"]["phash_distance"] = PHASH_DISTANCE
        profiles["demo"]["semantic_threshold"] = SEMANTIC_THRESHOLD
    out = Builds(one_node=base / "one-node", parted=base / "partitioned")
    keys_work, nodes_work = filter_partitioned._keys, phash_partitioned._nodes
    keys_seen, nodes_seen, failed = [], [], set()

    def keys_failing_once(tmp, p, k):
        keys_seen.append(k)
        if k == FAILING_KEYS and "keys" not in failed:
            failed.add("keys")
            raise RuntimeError(f"keys partition {k} fails this once")
        return keys_work(tmp, p, k)

    def nodes_failing_once(tmp, p, b):
        nodes_seen.append((p.root.name, b))
        if b == FAILING_NODES and "nodes" not in failed:  # the first plan's (every row)
            failed.add("nodes")
            raise RuntimeError(f"pHash nodes partition {b} fails this once")
        return nodes_work(tmp, p, b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDPIPE_CATALOG", str(catalog))
        mp.setenv("SDPIPE_PARTITIONED", "never")
        state = _build(out.one_node)
        assert state.is_completed(), state.message

        mp.setenv("SDPIPE_PARTITIONED", "always")
        # Several partitions on the demo's few rows: each stage's tasks see awkward splits.
        mp.setenv(filter_partitioned.TASK_MEMORY_ENV, "4000")
        mp.setenv(phash_partitioned.ROWS_PER_TASK_ENV, "16")
        mp.setenv(semantic_partitioned.TASK_ROWS_ENV, "16")  # input files, block pairs
        mp.setattr(semantic_partitioned, "ROWS_PER_RANGE", 20)  # the survivor rule's ranges
        mp.setattr(filter_partitioned, "_keys", keys_failing_once)
        mp.setattr(phash_partitioned, "_nodes", nodes_failing_once)
        state = _build(out.parted)
        assert state.is_failed()
        out.messages.append(state.message)
        assert not list((out.parted / "demo" / "filtered").glob("[0-9]*.parquet"))

        keys_seen.clear()
        state = _build(out.parted)
        assert state.is_failed()
        out.messages.append(state.message)
        out.keys_rerun = list(keys_seen)
        assert not list((out.parted / "demo" / "selected").glob("[0-9]*.parquet"))

        first_plan = nodes_seen[0][0]
        nodes_seen.clear()
        state = _build(out.parted)
        assert state.is_completed(), state.message
        out.nodes_rerun = [b for plan, b in nodes_seen if plan == first_plan]
    return out


def _counts(root: Path, stage: str) -> tuple:
    (record,) = read_stats(root, "demo", stage)
    return record.num_in, record.num_out, record.dropped


def test_partitioned_filter_and_filter_pixels_equal_one_node(builds):
    for stage in ("filtered", "selected"):
        tables = _tables(builds.parted / "demo" / stage)
        assert tables and tables == _tables(builds.one_node / "demo" / stage), stage
        assert _counts(builds.parted, stage) == _counts(builds.one_node, stage), stage
    (selected,) = read_stats(builds.parted, "demo", "selected")
    assert selected.dropped.get("duplicate_phash", 0) > 0  # the pHash level decided something
    assert selected.dropped.get("duplicate_semantic", 0) > 0  # and the semantic level
    phash = selected.extra["partitioned"]["phash"]
    assert phash["runs"] == 2 and phash["partitions"][0] > 2  # every row, then the kept ones
    assert phash["nodes"]  # each task's record says where it ran
    semantic = selected.extra["partitioned"]["semantic"]
    assert semantic["runs"] == 2 and semantic["partitions"][0] > 2 and semantic["nodes"]
    assert max(semantic["rounds"]) >= 2
    (one_node,) = read_stats(builds.one_node, "demo", "selected")
    assert "partitioned" not in one_node.extra
    # The one-node record alone has the missed-duplicate estimate (docs/scale-out.md).
    assert "semantic_missed_estimate" in one_node.extra
    assert "semantic_missed_estimate" not in selected.extra
    # Once the selection is written its partition files go (a failed run's stayed).
    assert not list((builds.parted / "demo" / "partitions").glob("phash-*"))
    assert not list((builds.parted / "demo" / "partitions").glob("semantic-*"))


def test_a_failed_partition_fails_the_build_naming_it_and_the_rerun_runs_it_alone(builds):
    filter_failed, phash_failed = builds.messages
    assert f"filter-keys-demo-{FAILING_KEYS:05d}" in filter_failed
    assert f"filter-pixels-phash-nodes-demo-{FAILING_NODES:05d}" in phash_failed
    assert builds.keys_rerun == [FAILING_KEYS]  # the other keys partitions were not run again
    assert builds.nodes_rerun == [FAILING_NODES]

    (record,) = read_stats(builds.parted, "demo", "filtered")
    summary = record.extra["partitioned"]
    assert summary["partitions"] > 2
    # Reused: every scatter task and every keys partition but the one that failed.
    num_inputs = len(list((builds.parted / "demo" / "metadata").glob("*.parquet")))
    assert summary["reused"] == num_inputs + summary["partitions"] - 1
    (selected,) = read_stats(builds.parted, "demo", "selected")
    phash = selected.extra["partitioned"]["phash"]
    # Reused in the first pHash run: its scatter tasks and the nodes partitions that finished.
    num_scatter = phash["partitions"][0]  # one input file of ROWS_PER_TASK rows per partition
    assert phash["reused"] >= num_scatter + phash["partitions"][0] - 1
