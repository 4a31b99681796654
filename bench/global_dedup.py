"""Partitioned pHash dedup (tasks.curation.phash_partitioned) against the one-node path.

Input: bench/dedup.py's uniform hashes with 1% planted near copies and 0.5% one blank hash,
plus one hot hash held by rows/30 rows (1M at 30M), ranks a random permutation. The rows go to
.npy files of --rows-per-task rows (not timed); the partitioned stages run in --nodes local
worker processes ("executor": "local-processes"; Ray comes later), then the one-node path
(`dedup.phash_losers`) on the same rows where it fits (--one-node-max-rows).
cpu_seconds: the tasks' CPU seconds; peak_task_rss_gb: the largest worker's peak (a worker's
high-water mark over the tasks it ran); temp_bytes: the most the partition files held at once.
Prints one JSON line per run, last.
--semantic: semantic dedup instead (bench/global_semantic.py), the same keys.
Usage: python bench/global_dedup.py --rows N --nodes K [--rows-per-task M] [--workdir DIR]
       [--semantic [--dim D] [--slots-per-task S]]
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
import shutil
import tempfile
import time

import numpy as np
from dedup import machine, peak_rss_gb, planted_copies

from tasks.curation import phash_partitioned as pp
from tasks.curation.partition_files import LocalProcesses, folder_bytes

HOT = np.uint64(0x5DEECE66D5DEECE6)  # the hot hash: a placeholder image many times over
GOALS = {"agreement": 1.0, "cpu_overhead": 1.2, "largest_task_share": "2 / partitions"}


def rows_for(n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(hashes, rank, planted copies, their originals)."""
    hashes, copies, originals = planted_copies(n, k)
    rng = np.random.default_rng(2)
    hashes[rng.choice(n, max(1, n // 30), replace=False)] = HOT
    return hashes, rng.permutation(n), copies, originals


def planted_recall(hashes, copies, originals, lost, k) -> tuple[float, int]:
    """Of the planted (copy, original) pairs still within k bits (a later plant may overwrite
    one), the share where not both survive; and how many there are."""
    near = (copies != originals) & (np.bitwise_count(hashes[copies] ^ hashes[originals]) <= k)
    found = lost[copies[near]] | lost[originals[near]]
    return round(float(found.mean()), 6), int(near.sum())


def bench(args) -> dict:
    hashes, rank, copies, originals = rows_for(args.rows, args.max_distance)
    root = Path(tempfile.mkdtemp(prefix="sdpipe-bench-global-dedup-", dir=args.workdir))
    out: dict = {"bench": "global_dedup", "rows": args.rows, "nodes": args.nodes}
    try:
        paths = pp.write_inputs(root / "inputs", hashes, rank, args.rows_per_task)
        input_bytes = folder_bytes(root / "inputs")
        plan = pp.make_plan(
            paths,
            args.rows,
            args.max_distance,
            root / "work",
            rows_per_task=args.rows_per_task,
            tables_per_pass=args.tables_per_pass,
        )
        load_before = machine()["load_avg_1m"]
        with LocalProcesses(args.nodes) as workers:
            workers.map(_warm, [(i,) for i in range(args.nodes)])  # spawn before the clock
            start = time.perf_counter()
            run = pp.run_phash(plan, workers)
            seconds = time.perf_counter() - start
        lost = run.dropped()[rank]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cpu = [r["cpu_seconds"] for r in run.records]
    stages: dict[str, float] = {}
    for r in run.records:
        stage = r["task"].split("/")[0]
        stages[stage] = round(stages.get(stage, 0) + r["cpu_seconds"], 2)
    largest = max(run.records, key=lambda r: r["cpu_seconds"])
    recall, num_planted = planted_recall(hashes, copies, originals, lost, args.max_distance)
    out |= {
        "partitions": plan.num_parts,
        "tasks": len(run.records),
        "executor": "local-processes",
        "seconds": round(seconds, 2),
        "cpu_seconds": round(sum(cpu), 2),
        "largest_task_share": round(largest["cpu_seconds"] / sum(cpu), 4),
        "largest_task": largest["task"],
        "share_goal": round(2 / plan.num_parts, 4),
        "peak_task_rss_gb": round(max(r["peak_rss_gb"] for r in run.records), 3),
        "temp_bytes": run.peak_temp_bytes,
        "temp_bytes_per_row": round(run.peak_temp_bytes / args.rows, 1),
        "input_bytes": input_bytes,
        "stage_cpu_seconds": stages,
        "rounds": run.rounds,
        "tables": plan.num_tables,
        "tables_per_pass": plan.tables_per_pass,
        "rows_per_task": args.rows_per_task,
        "max_distance": args.max_distance,
        "dropped": int(lost.sum()),
        "hot_rows": max(1, args.rows // 30),
        "planted_pairs": num_planted,
        "planted_recall": recall,
        "load_avg_1m_before": load_before,
    }
    if args.rows <= args.one_node_max_rows:
        out |= one_node(hashes, rank, lost, args.max_distance, sum(cpu))
    return out | {"goals": GOALS} | machine()


def _warm(i: int) -> dict:
    return {}


def one_node(hashes, rank, lost, k, partitioned_cpu) -> dict:
    from tasks.curation.dedup import phash_losers

    start, cpu = time.perf_counter(), time.process_time()
    expected = phash_losers(hashes, rank, k)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "one_node_seconds": round(seconds, 2),
        "one_node_cpu_seconds": round(cpu, 2),
        "one_node_peak_rss_gb": peak_rss_gb(),  # this process: input, both results, one node
        "cpu_overhead": round(partitioned_cpu / cpu, 3),
        "agreement": round(float((expected == lost).mean()), 9),
        "disagreeing_rows": int((expected != lost).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rows-per-task", type=int, default=pp.ROWS_PER_TASK)
    parser.add_argument("--tables-per-pass", type=int, default=pp.TABLES_PER_PASS)
    parser.add_argument("--max-distance", type=int, default=4)
    parser.add_argument("--one-node-max-rows", type=int, default=30_000_000)
    parser.add_argument("--workdir", default=None, help="where the partition files go")
    parser.add_argument("--semantic", action="store_true", help="see bench/global_semantic.py")
    parser.add_argument("--dim", type=int, default=768, help="--semantic: CLIP ViT-L/14's")
    parser.add_argument("--threshold", type=float, default=0.95, help="--semantic: cosine")
    parser.add_argument("--max-visits", type=int, default=2, help="--semantic")
    parser.add_argument("--rows-per-file", type=int, default=65536, help="--semantic: inputs")
    parser.add_argument("--slots-per-task", type=int, default=65536, help="--semantic: scans")
    args = parser.parse_args()
    if args.semantic:
        from global_semantic import bench_semantic

        print(json.dumps(bench_semantic(args)), flush=True)
        return
    print(json.dumps(bench(args)), flush=True)


if __name__ == "__main__":
    main()
