"""fetch-images on 1, 2 and 3 nodes of a local Ray cluster: images/s and scaling; prints JSON last.

Per node count k: a fresh local cluster of k worker nodes (tests/ray_cluster.py: a CPU-less head
and k raylets on this machine), `flows.execution.cluster.Cluster` on it with the same downloader
budget on every node (`--processes` x `--threads` requests in flight, `--fetch-shards` shard tasks
at once, `--workers`), and `--urls-per-node` x k URLs from bench/fetch.py's latency server (its
own process, [0.5, 1.5] x `--latency-ms`). The stage runs as build-latents runs it on a
cluster: one Prefect task run per shard (`flows.execution.stages.run_stage`, in a flow on a
temporary server), each the shard's `fetch_images_shard` through `Cluster.unit` on the node with
most room, the stage's limit the sum of the nodes' own (`stage_limits`).

The design choice a reader would get wrong: every node here shares this machine's cores, so the
budget is kept small (and the JPEGs smaller than bench/fetch.py's) for the cores not to be the
limit at 3 nodes; the JSON gives the machine's and the cluster's CPU use per run to show it.
Warm-up is left out: every agent first runs one round of shards (its downloader processes import
img2dataset, its decode workers start), then the timed stage runs from its first shard's
dispatch to its last shard's end. A real fetch runs for days: start-up is not its rate.

Usage: python bench/cluster.py [--nodes 1,2,3] [--urls-per-node N] [--repeat R]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize: the repository root takes its place.
REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)

import argparse
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

from bench import fetch

GOAL_EFFICIENCY = 0.85
SOURCE, WARM = "bench", "warmup"
SIZE = fetch.SIZE  # the stage's output side (none of these images is bigger)


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def role(p) -> str:
    """What a process of the cluster's tree is, for the CPU breakdown."""
    cmd = " ".join(p.cmdline())
    for key, name in (
        ("tasks.sources.fetch_images", "downloaders"),
        ("tasks.latents.images", "decode_workers"),
        ("prefect", "prefect_server"),
        ("raylet", "raylets"),
        ("gcs_server", "ray_gcs"),
        ("NodeAgent", "agents"),
        ("default_worker", "ray_workers"),
    ):
        if key in cmd or key in p.name():
            return name
    return "driver" if p.pid == os.getpid() else "ray_other"


def tree_cpu_s(pids: list[int]) -> dict[str, float]:
    """User + system CPU-seconds of these processes and all their descendants alive now, by
    role."""
    import psutil

    total: dict[str, float] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in tree:
            try:
                t, name = p.cpu_times(), role(p)
            except psutil.NoSuchProcess:
                continue
            total[name] = total.get(name, 0.0) + t.user + t.system
    return total


class CpuWindow:
    """CPU use between `start()` and `stop()`: the machine's busy fraction (every process, the
    other developers' included) and, in cores, this cluster's process tree and the server's."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid

    def start(self) -> None:
        self.t0, self.m0 = time.perf_counter(), machine_jiffies()
        self.c0, self.s0 = tree_cpu_s([os.getpid()]), tree_cpu_s([self.server_pid])
        self.l0 = os.getloadavg()[0]

    def stop(self) -> dict:
        seconds = time.perf_counter() - self.t0
        busy, total = (b - a for a, b in zip(self.m0, machine_jiffies(), strict=True))
        roles = tree_cpu_s([os.getpid()])
        by_role = {k: v - self.c0.get(k, 0.0) for k, v in roles.items()}
        cluster = sum(by_role.values())
        server = sum(tree_cpu_s([self.server_pid]).values()) - sum(self.s0.values())
        return {
            "machine_busy": round(busy / total, 3),
            "cluster_cores": round(cluster / seconds, 2),
            "server_cores": round(server / seconds, 2),
            "cluster_cpu_ms_per_url": None,  # filled by the caller, who knows the URLs
            "cluster_cpu_s": round(cluster, 1),
            "cluster_cpu_s_by_role": {k: round(v, 1) for k, v in sorted(by_role.items())},
            "load_avg_1m": [round(self.l0, 2), round(os.getloadavg()[0], 2)],
        }


def write_shards(root: Path, source: str, base: str, n: int, shard_size: int) -> list[str]:
    """`n` URLs as the source's filtered shards of `shard_size`: the shard names."""
    import pyarrow.parquet as pq

    table = fetch.urls_table(base, n)
    folder = root / source / "filtered"
    folder.mkdir(parents=True)
    names = []
    for i, start in enumerate(range(0, n, shard_size)):
        names.append(f"{i:05d}")
        pq.write_table(table.slice(start, shard_size), folder / f"{names[-1]}.parquet")
    return names


def run_nodes(k: int, args, base: str) -> dict:
    """One measurement on a fresh cluster of `k` nodes (in a fresh process: see `main`)."""
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.build_latents import TASK_THREADS, stage_limits, with_node
    from flows.execution.cluster import Cluster
    from flows.execution.stages import run_stage
    from tasks.sources import fetch_images
    from tests.ray_cluster import LocalCluster

    started = time.perf_counter()
    local = LocalCluster(k, cpus=args.cpus)
    up_s = time.perf_counter() - started
    try:
        cluster = Cluster(local.address, workers=args.workers)
    except BaseException:
        local.shutdown()
        raise
    agents_s = time.perf_counter() - started - up_s
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    root = work / "data"
    try:
        limit = cluster.limits(functools.partial(stage_limits, archive=False))["shards"]

        def unit(source: str, shard: str):
            return cluster.unit(
                "shards",
                with_node(
                    functools.partial(
                        fetch_images.fetch_images_shard,
                        root,
                        source,
                        shard,
                        image_size=SIZE,
                        min_side=0,
                        allow_private_hosts=True,  # served on 127.0.0.1
                    )
                ),
            )

        def stage(source: str, units: dict):
            """The fetch stage over `units` as build-latents runs it: a task run per shard."""

            @flow(name=f"bench-cluster-{source}", task_runner=ThreadPoolTaskRunner(TASK_THREADS))
            def fetch_stage():
                return run_stage(root, source, "shards", units, limit=limit)

            done, failed = fetch_stage()
            if failed:
                raise SystemExit(f"{source}: shards failed: {failed}")
            return done

        # Warm-up: one round of shards at the stage's limit, spread over the nodes (each node's
        # downloaders and decode workers started, every shard thread used once), through a flow
        # (the temporary Prefect server started, the task engine warm).
        per_warm = args.processes * args.threads * 2
        warm = write_shards(root, WARM, base, limit * per_warm, per_warm)
        warm_nodes = {s["node"] for s in stage(WARM, {s: unit(WARM, s) for s in warm}).values()}
        if len(warm_nodes) != k:
            raise SystemExit(f"warm-up reached {sorted(warm_nodes)}, not {k} nodes")
        warm_s = time.perf_counter() - started - up_s - agents_s

        num_urls = args.urls_per_node * k
        shards = write_shards(root, SOURCE, base, num_urls, args.shard_size)
        spans: list[tuple[float, float, str, int]] = []
        lock = threading.Lock()

        def timed(shard: str):
            run = unit(SOURCE, shard)

            def call():
                t0 = time.perf_counter()
                stats = run()
                with lock:
                    spans.append((t0, time.perf_counter(), stats.node, stats.num_out))
                return stats

            return call

        fetch.get_json(f"{base}/reset")
        window = CpuWindow(args.server_pid)
        window.start()
        done = stage(SOURCE, {s: timed(s) for s in shards})
        cpu = window.stop()
        server = fetch.get_json(f"{base}/stats")
    finally:
        cluster.shutdown()
        local.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    seconds = max(e for _, e, _, _ in spans) - min(s for s, _, _, _ in spans)
    ok = sum(n for *_, n in spans)
    per_node: dict[str, list] = {}  # node -> [first start, last end, images]
    for start, end, node, n in spans:
        first, last, images = per_node.get(node, [start, end, 0])
        per_node[node] = [min(first, start), max(last, end), images + n]
    cpu["cluster_cpu_ms_per_url"] = round(1000 * cpu["cluster_cpu_s"] / num_urls, 2)
    return {
        "nodes": k,
        "urls": num_urls,
        "ok": ok,
        "shards": len(done),
        "shard_limit": limit,
        "seconds": round(seconds, 2),
        "images_per_s": round(ok / seconds, 1),
        # Each node's images over its own first start to last end.
        "per_node_images_per_s": sorted(round(n / (e - s), 1) for s, e, n in per_node.values()),
        "per_node_ideal_images_per_s": round(
            args.processes * args.threads / (args.latency_ms / 1000), 1
        ),
        "max_in_flight": server["max_in_flight"],
        "requests": server["requests"],
        **cpu,
        "startup_s": {
            "cluster": round(up_s, 1),
            "agents": round(agents_s, 1),
            "warm": round(warm_s, 1),
        },
    }


def measure(k: int, args, base: str, server_pid: int) -> dict:
    """`run_nodes(k)` in a fresh process (its own Ray connection and Prefect server)."""
    with tempfile.TemporaryDirectory(prefix="bench-cluster-prefect-") as home:
        env = {
            **os.environ,
            "PREFECT_HOME": home,  # a temporary server of its own, not ~/.prefect's database
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "SDPIPE_FETCH_PROCESSES": str(args.processes),
            "SDPIPE_FETCH_THREADS": str(args.threads),
            "SDPIPE_FETCH_SHARDS": str(args.fetch_shards),
            "NO_ALBUMENTATIONS_UPDATE": "1",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        }
        for name in ("PREFECT_API_URL", "RAY_ADDRESS", "SDPIPE_WORKERS"):
            env.pop(name, None)
        cmd = [sys.executable, __file__, "--run-nodes", str(k), "--base", base]
        cmd += ["--server-pid", str(server_pid), *sys.argv[1:]]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{k} nodes failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,2,3", help="node counts, comma-separated")
    parser.add_argument("--urls-per-node", type=int, default=3000)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--latency-ms", type=float, default=200)
    parser.add_argument("--width", type=int, default=384, help="served JPEGs' width (>= 256)")
    parser.add_argument("--height", type=int, default=288, help="served JPEGs' height (>= 256)")
    parser.add_argument("--unique", type=int, default=200)
    parser.add_argument("--processes", type=int, default=1, help="downloaders per node")
    parser.add_argument("--threads", type=int, default=16, help="threads per downloader")
    parser.add_argument("--fetch-shards", type=int, default=2, help="shard tasks per node")
    parser.add_argument("--workers", type=int, default=2, help="each node's worker budget")
    parser.add_argument("--cpus", type=int, default=2, help="each node's Ray CPUs")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--run-nodes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_nodes:
        print(json.dumps(run_nodes(args.run_nodes, args, args.base)))
        return
    counts = [int(x) for x in args.nodes.split(",")]
    folder = fetch.image_folder(args.unique, args.width, args.height)
    jpeg_kb = sum(p.stat().st_size for p in folder.glob("*.jpg")) / args.unique / 1024
    server = subprocess.Popen(
        [
            sys.executable,
            fetch.__file__,
            "--serve",
            str(folder),
            "--latency-ms",
            str(args.latency_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    runs: dict[int, list[dict]] = {k: [] for k in counts}
    try:
        base = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        for r in range(args.repeat):  # alternating order, so every count sees the same machine
            for k in counts if r % 2 == 0 else counts[::-1]:
                res = measure(k, args, base, server.pid)
                runs[k].append(res)
                print(
                    f"{k} node(s), run {r + 1}: {res['ok']}/{res['urls']} images in "
                    f"{res['seconds']:.1f} s = {res['images_per_s']:.1f} images/s "
                    f"(per node {res['per_node_images_per_s']}), max {res['max_in_flight']} in "
                    f"flight, machine {100 * res['machine_busy']:.0f}% busy, cluster "
                    f"{res['cluster_cores']} cores, server {res['server_cores']} cores, load "
                    f"{res['load_avg_1m']}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait()
    best = {k: max(rs, key=lambda x: x["images_per_s"]) for k, rs in runs.items()}
    ips = {k: b["images_per_s"] for k, b in best.items()}
    top = max(counts)
    efficiency = ips[top] / (top * ips[1]) if 1 in ips else None
    print(
        json.dumps(
            {
                "bench": "cluster",
                "stage": "fetch-images",
                "latency_ms": args.latency_ms,
                "image": f"{args.width}x{args.height} q{fetch.QUALITY}",
                "jpeg_kb": round(jpeg_kb, 1),
                "urls_per_node": args.urls_per_node,
                "shard_size": args.shard_size,
                "per_node_budget": {
                    "workers": args.workers,
                    "ray_cpus": args.cpus,
                    "fetch_processes": args.processes,
                    "fetch_threads": args.threads,
                    "fetch_shards": args.fetch_shards,
                },
                "images_per_s": {str(k): v for k, v in ips.items()},
                "scaling_efficiency": round(efficiency, 3) if efficiency else None,
                "efficiency_nodes": top,
                "goal_efficiency": GOAL_EFFICIENCY,
                "met": efficiency is not None and efficiency >= GOAL_EFFICIENCY,
                "best": {str(k): b for k, b in best.items()},
                "runs_images_per_s": {
                    str(k): [x["images_per_s"] for x in rs] for k, rs in runs.items()
                },
                "warmup_excluded": True,
                "cores": len(os.sched_getaffinity(0)),
            }
        )
    )


if __name__ == "__main__":
    main()
