"""Partitioned metadata filter (tasks.curation.filter_partitioned) beside the one-node filter.

Both run the same stage (rules, waterfall, key and URL dedup, key-ordered shards) over the same
LAION-like rows (bench/filter.py's generator, cached), under a profile that keeps most rows
(`loose`: sides and URL dedup; the one-node URL dedup then sees them all). The one-node stage
runs in a worker process of its own (its peak RSS is its own), spilling under its data root
as it does; the partitioned one runs its tasks in --workers local processes, each under
--task-memory with spilling off. agreement: the share of shards byte-identical (with the same
names), beside `waterfall_equal`. temp_bytes: the partition files at their largest.
--hot-url-rows H plants one URL on H rows spread over the files; largest_urls_share: the largest
urls task's rows over all of theirs (1/partitions when even).
Usage: python bench/global_filter.py --rows N [--workers K] [--task-memory BYTES]
       [--one-node-memory SIZE] [--work-dir D] [--hot-url-rows H]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path (bench/tokenize.py would shadow the
# standard library's): the repository root takes its place, and bench/ goes after it.
sys.path[0] = str(Path(__file__).resolve().parent.parent)
sys.path.append(str(Path(__file__).resolve().parent))

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np
from filter import cached_files, spilled_bytes

from catalog import FilterProfile
from tasks.curation import duck
from tasks.curation import filter_partitioned as fp
from tasks.curation.partition_files import LocalProcesses, peak_rss_gb

SOURCE = "laion"
LOOSE = FilterProfile(name="loose", min_side=256, dedup=("url",))


def data_root(parent: Path, name: str, paths: list[Path]) -> Path:
    root = parent / name
    (root / SOURCE / "metadata").mkdir(parents=True)
    for path in paths:
        (root / SOURCE / "metadata" / path.name).symlink_to(path)
    return root


def plant_hot_url(paths: list[Path], num_rows: int, folder: Path) -> list[Path]:
    """Copies of `paths` (under `folder`) with every k-th row's URL one URL, num_rows in all."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from tasks.sources import table as sample_table

    total = sum(pq.read_metadata(p).num_rows for p in paths)
    stride, at, out = max(1, total // max(1, num_rows)), 0, []
    for path in paths:
        table = pq.read_table(path)
        index = np.arange(at, at + len(table))
        hot = pa.array((index % stride == 0) & (index // stride < num_rows))
        url = pc.if_else(hot, pa.scalar("http://hot.example/placeholder.png"), table["url"])
        table = table.set_column(table.schema.get_field_index("url"), "url", url)
        sample_table.write_table(table, folder / path.name)
        out.append(folder / path.name)
        at += len(table)
    return out


def one_node(root: Path, per_shard: int, memory_limit: str) -> dict:
    """The one-node stage (run in a worker process) under DuckDB `memory_limit`, spilling under
    its data root: time, CPU, peak RSS, spill at its peak."""
    from tasks.curation import filter as filter_stage

    os.environ[duck.MEMORY_ENV] = memory_limit

    spill_dir, peak, done = duck.temp_directory(root), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], spilled_bytes(spill_dir) if spill_dir.exists() else 0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        stats = filter_stage.filter_metadata(root, SOURCE, LOOSE, per_shard)
    finally:
        done.set()
        watcher.join()
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "cpu_seconds": round(time.process_time() - cpu, 2),
        "peak_rss_gb": round(peak_rss_gb(), 3),
        "spill_bytes": peak[0],
        "kept": stats.num_out,
        "dropped": stats.dropped,
        "memory_limit": stats.extra["duckdb"]["memory_limit"],
    }


def _warm(i: int) -> dict:
    return {}


def agreement(a: Path, b: Path) -> tuple[float, int, bool]:
    """(share of shards byte-identical, shard count, waterfalls equal)."""
    mine = sorted(p.name for p in (a / SOURCE / "filtered").glob("[0-9]*.parquet"))
    theirs = sorted(p.name for p in (b / SOURCE / "filtered").glob("[0-9]*.parquet"))
    same = sum(
        (a / SOURCE / "filtered" / n).read_bytes() == (b / SOURCE / "filtered" / n).read_bytes()
        for n in set(mine) & set(theirs)
    )
    wf = [json.loads((r / SOURCE / "filtered" / "waterfall.json").read_text()) for r in (a, b)]
    return round(same / max(1, len(mine), len(theirs)), 6), len(mine), wf[0] == wf[1]


def bench(args) -> dict:
    paths, _ = cached_files(args.rows, args.cache_dir)
    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-global-filter-", dir=args.work_dir))
    out: dict = {"bench": "global_filter", "rows": args.rows, "profile": LOOSE.name}
    try:
        if args.hot_url_rows:
            (work / "planted").mkdir()
            paths = plant_hot_url(paths, args.hot_url_rows, work / "planted")
        one_root = data_root(work, "one", paths)
        parts_root = data_root(work, "parts", paths)
        load_before = round(os.getloadavg()[0], 2)
        with LocalProcesses(args.workers) as workers:
            workers.map(_warm, [(i,) for i in range(args.workers)])  # spawn before the clock
            start, cpu = time.perf_counter(), time.process_time()
            stats = fp.filter_metadata(
                parts_root,
                SOURCE,
                LOOSE,
                args.samples_per_shard,
                executor=workers,
                memory=args.task_memory,
            )
            seconds, driver_cpu = time.perf_counter() - start, time.process_time() - cpu
        summary = stats.extra["partitioned"]
        try:
            with LocalProcesses(1) as side:  # a fresh process: its peak RSS is the stage's
                call = (one_root, args.samples_per_shard, args.one_node_memory)
                single = side.map(one_node, [call])[0]
            share, num_shards, wf_equal = agreement(one_root, parts_root)
        except BrokenProcessPool as exc:  # killed (out of memory on a shared machine)
            single, share, num_shards, wf_equal = {"error": str(exc)}, None, None, None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    task_cpu = summary.pop("task_cpu_seconds")
    out |= {
        "partitions": summary["partitions"],
        "tasks": summary["tasks"],
        "workers": args.workers,
        "task_memory": args.task_memory,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(task_cpu + driver_cpu, 2),
        "peak_task_rss_gb": summary["peak_task_rss_gb"],
        "largest_task_share": summary["largest_task_share"],
        "hot_url_rows": args.hot_url_rows,
        "largest_urls_share": summary["largest_urls_share"],
        "temp_bytes": summary["temp_bytes"],
        "temp_bytes_per_row": round(summary["temp_bytes"] / max(1, args.rows), 1),
        "spill_bytes": 0,  # spilling is off in every task: one over its memory fails instead
        "input_bytes": summary["input_bytes"],
        "agreement": share,
        "waterfall_equal": wf_equal,
        "kept": stats.num_out,
        "dropped": stats.dropped,
        "shards": num_shards,
        "one_node_seconds": single.get("seconds"),
        "one_node_cpu_seconds": single.get("cpu_seconds"),
        "one_node_peak_rss_gb": single.get("peak_rss_gb"),
        "one_node_spill_bytes": single.get("spill_bytes"),
        "one_node_memory_limit": args.one_node_memory,
        "one_node_error": single.get("error"),
        "same_counts": single.get("kept") == stats.num_out
        and single.get("dropped") == stats.dropped,
        "load_avg_1m_before": load_before,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "machine": f"{os.uname().machine} {os.cpu_count()} cores",
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--task-memory", type=int, default=fp.TASK_MEMORY)
    # The one-node stage's DuckDB memory (it spills past it, as at full scale).
    parser.add_argument("--one-node-memory", default="4GB")
    parser.add_argument("--samples-per-shard", type=int, default=10_000)
    parser.add_argument("--hot-url-rows", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/sdpipe/bench")
    parser.add_argument("--work-dir", type=Path, default=None, help="the data roots' disk")
    print(json.dumps(bench(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
