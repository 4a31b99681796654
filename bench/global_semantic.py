"""`global_dedup.py --semantic`: partitioned semantic dedup (tasks.curation.semantic_partitioned)
against the one-node path (`SemanticIndex`, its store on disk) at the same centroids.

Input: N random unit embeddings of --dim (fp16) with planted near-duplicate groups: 1% of rows
are copies (cosine ~0.993-0.9998) of 0.4% originals, groups of 1-4 copies, scattered over the
files. Centroids: k-means on a sample as the one-node path fits them, once (`fit_cpu_seconds`,
counted in both paths' CPU). Every process runs torch on one thread (`threads_per_task`), so CPU
seconds count work, not spinning. The partitioned tasks run in --nodes local worker processes.
planted_pairs_beyond_visits: planted pairs whose ends' clusters (own and visited) share none,
which neither path compares (the `max_visits` cap; isotropic rows are in reach of every centroid);
such a pair is still found when an end goes to another copy of the group.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from dedup import machine, peak_rss_gb

GOALS = {"agreement": 1.0, "planted_recall": 1.0, "cpu_overhead": 1.2}


def embeddings(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 [n, dim] unit rows, planted (copy, original) pairs)."""
    rng = np.random.default_rng(seed)
    x = np.empty((n, dim), np.float16)
    for start in range(0, n, 65536):
        chunk = rng.standard_normal((min(65536, n - start), dim), np.float32)
        x[start : start + len(chunk)] = chunk / np.linalg.norm(chunk, axis=1, keepdims=True)
    rows = rng.permutation(n)[: n // 100 + n // 250]
    originals, copies = rows[: n // 250], rows[n // 250 :]
    group = rng.integers(0, len(originals), len(copies))
    noise = rng.standard_normal((len(copies), dim), np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    near = (
        x[originals[group]].astype(np.float32) + rng.uniform(0.02, 0.12, (len(copies), 1)) * noise
    )
    x[copies] = near / np.linalg.norm(near, axis=1, keepdims=True)
    return x, np.stack([copies, originals[group]], axis=1)


def planted_recall(x, pairs, lost, threshold) -> tuple[float, int]:
    """Of the planted pairs at cosine >= threshold (float64), the share where not both survive."""
    a, b = (x[pairs[:, i]].astype(np.float64) for i in (0, 1))
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    true = pairs[cosine >= threshold]
    found = lost[true[:, 0]] | lost[true[:, 1]]
    return round(float(found.mean()), 6), len(true)


def pairs_beyond_visits(x, pairs, threshold, centroids, max_visits) -> int:
    """Of the planted pairs at cosine >= threshold, how many have ends whose clusters (own and
    visited, as `assign` picks them; visitor caps aside) share none: no path compares them."""
    import math

    from tasks.curation.semantic_dedup import CPU, assign, unit

    a, b = (x[pairs[:, i]].astype(np.float64) for i in (0, 1))
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    true = pairs[cosine >= threshold]
    if len(centroids.centroids) < 2 or not len(true):
        return 0
    reach = math.sqrt(max(0.0, 2 - 2 * threshold))
    m = min(max_visits, len(centroids.centroids) - 1)
    sets = []
    for end in (true[:, 0], true[:, 1]):
        nearest, visited, _, _ = assign(
            unit(x[end], CPU) - centroids.center, centroids.centroids, reach, m
        )
        sets.append(np.concatenate([nearest[:, None].numpy(), visited.numpy()], axis=1))
    # -1 (no visit) on both sides would match: it becomes -2 on one side.
    left, right = sets[0], np.where(sets[1] < 0, -2, sets[1])
    meet = (left[:, :, None] == right[:, None, :]).any(axis=(1, 2))
    return int((~meet).sum())


def bench_semantic(args) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned workers' torch reads it on import
    import torch

    from tasks.curation import semantic_partitioned as sp
    from tasks.curation.partition_files import LocalProcesses, folder_bytes
    from tasks.curation.semantic_dedup import Parts, fit_centroids, num_clusters_for, screen

    torch.set_num_threads(1)
    x, pairs = embeddings(args.rows, args.dim)
    rank = np.random.default_rng(1).permutation(args.rows)
    k = num_clusters_for(args.rows)
    parts = Parts.from_array(x, part_rows=args.rows_per_file)
    cpu = time.process_time()
    centroids = fit_centroids(
        parts, k, screen(torch.device("cpu"))[0], np.random.default_rng(0), torch.Generator()
    )
    fit_cpu = time.process_time() - cpu
    root = Path(tempfile.mkdtemp(prefix="sdpipe-bench-global-semantic-", dir=args.workdir))
    out: dict = {"bench": "global_dedup", "mode": "semantic", "rows": args.rows}
    out |= {"nodes": args.nodes, "dim": args.dim, "threshold": args.threshold}
    try:
        paths = sp.write_inputs(root / "inputs", x, rank, args.rows_per_file)
        input_bytes = folder_bytes(root / "inputs")
        plan = sp.make_plan(
            paths,
            args.rows,
            args.threshold,
            centroids,
            root / "work",
            max_visits=args.max_visits,
            slots_per_task=args.slots_per_task,
        )
        load_before = machine()["load_avg_1m"]
        with LocalProcesses(args.nodes) as workers:
            workers.map(_warm, [(i,) for i in range(args.nodes)])  # spawn before the clock
            start = time.perf_counter()
            run = sp.run_semantic(plan, workers)
            seconds = time.perf_counter() - start
        lost, num_scan_tasks = run.dropped(), len(sp.pieces(plan))
        shutil.rmtree(root / "work")  # the one-node store's disk next
        if args.rows <= args.one_node_max_rows:
            out |= one_node(parts, rank, args, centroids, root / "one-node", lost)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cpu = fit_cpu + sum(r["cpu_seconds"] for r in run.records)
    stages: dict[str, float] = {}
    for r in run.records:
        stage = r["task"].split("/")[0]
        stages[stage] = round(stages.get(stage, 0) + r["cpu_seconds"], 2)
    largest = max(run.records, key=lambda r: r["cpu_seconds"])
    recall, num_planted = planted_recall(x, pairs, lost, args.threshold)
    beyond = pairs_beyond_visits(x, pairs, args.threshold, centroids, plan.max_visits)
    if "one_node_cpu_seconds" in out:
        out["one_node_cpu_seconds"] = round(out["one_node_cpu_seconds"] + fit_cpu, 2)
        out["cpu_overhead"] = round(cpu / out["one_node_cpu_seconds"], 3)
    scans = [r for r in run.records if r["task"].startswith("scans")]
    return (
        out
        | {
            "partitions": k,  # partition files are by centroid; scans group or split them
            "scan_tasks": num_scan_tasks,
            "row_ranges": plan.num_parts,
            "tasks": len(run.records),
            "executor": "local-processes",
            "threads_per_task": 1,
            "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "fit_cpu_seconds": round(fit_cpu, 2),
            "largest_task_share": round(largest["cpu_seconds"] / cpu, 4),
            "largest_task": largest["task"],
            "peak_task_rss_gb": round(max(r["peak_rss_gb"] for r in run.records), 3),
            "temp_bytes": run.peak_temp_bytes,
            "temp_bytes_per_row": round(run.peak_temp_bytes / args.rows, 1),
            "input_bytes": input_bytes,
            "stage_cpu_seconds": stages,
            "rounds": run.rounds,
            "slots": sum(r["slots"] for r in run.records if r["task"].startswith("map")),
            "largest_scan_slots": max(r["slots"] for r in scans),
            "slots_per_task": args.slots_per_task,
            "rows_per_file": args.rows_per_file,
            "dropped": int(lost.sum()),
            "planted_pairs": num_planted,
            "planted_recall": recall,
            "planted_pairs_beyond_visits": beyond,  # recall >= 1 - beyond / planted
            "load_avg_1m_before": load_before,
        }
        | {"goals": GOALS}
        | machine()
    )


def _warm(i: int) -> dict:
    import torch  # noqa: F401  (imported before the clock, as the pHash mode spawns)

    return {}


def one_node(parts, rank, args, centroids, workdir: Path, lost) -> dict:
    from tasks.curation.semantic_dedup import SemanticIndex

    workdir.mkdir()
    start, cpu = time.perf_counter(), time.process_time()
    index = SemanticIndex(
        parts,
        rank,
        args.threshold,
        max_visits=args.max_visits,
        workdir=workdir,
        centroids=centroids,
    )
    expected = index.losers()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "one_node_seconds": round(seconds, 2),
        "one_node_cpu_seconds": round(cpu, 2),  # with the fit, as the partitioned path's
        "one_node_peak_rss_gb": peak_rss_gb(),  # this process: the input, the index, results
        "one_node_temp_bytes": index.temp_bytes,
        "agreement": round(float((expected == lost).mean()), 9),
        "disagreeing_rows": int((expected != lost).sum()),
    }
