"""Dedup at scale: pHash near-duplicates over N hashes, or semantic dedup over N embeddings.

pHash (`tasks.curation.dedup.phash_losers`, end to end: distinct hashes, pairs, survivor rule):
- default: uniform 64-bit hashes plus 1% planted near copies and 0.5% one blank hash;
- `--clustered`: hashes as real pHashes cluster: 2% near-blank (4 flat patterns, 0-3 of 16
  noisy bits flipped), 5% templated (groups of Zipf sizes up to 5,000, 0-6 of a template's
  20 variable bits flipped), 3% re-encoded copies (0-4 bits), 90% unique. Runs N/10 first in
  the same process: `growth_10x` = seconds(N) / seconds(N/10).
`--semantic`: N x 768 CLIP-like embeddings (a shared direction, topics of Zipf-like sizes,
subtopics; 4% near copies at cosine ~0.96-0.999, some copies of copies; 2% near misses at
~0.89-0.94; 0.5% in placeholder blobs), SemDeDup on the device with its store on disk (the
temporary folder's peak bytes per row, the estimate of missed duplicates); then a 50k sample
of them judged by clusters and by all pairs.
Prints one JSON object, last.
Usage: python bench/dedup.py [--rows N] [--clustered | --semantic] [--max-distance K]
       [--sample M] [--device D]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import math
import os
import platform
import resource
import tempfile
import time

import numpy as np

PHASH_GOALS = {"seconds": 120, "growth_10x": 15}  # at 10M clustered hashes, this machine
SEMANTIC_GOALS = {"seconds": 300, "agreement": 1.0}  # at 1M x 768, CPU


def planted_hashes(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """(hashes, number of planted near copies): uniform, 1% near copies, 0.5% one blank."""
    hashes, copies, _ = planted_copies(n, k, seed)
    return hashes, copies.size


def planted_copies(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`planted_hashes`'s hashes, with the rows of its copies and of their originals."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
    copies = rng.choice(n, n // 100, replace=False)
    originals = rng.integers(0, n, copies.size)
    hashes[copies] = hashes[originals] ^ flips(rng, copies.size, 64, k)
    hashes[rng.choice(n, n // 200, replace=False)] = 0  # a blank image, many times over
    return hashes, copies, originals


def flips(rng: np.random.Generator, n: int, positions, most: int) -> np.ndarray:
    """n masks of 0..`most` bits drawn from `positions` (an int: 0..positions-1; an array
    [n, p]: row i's own p positions); draws may repeat, so some masks have fewer bits."""
    count = rng.integers(0, most + 1, n)
    mask = np.zeros(n, np.uint64)
    for f in range(1, most + 1):
        rows = np.flatnonzero(count >= f)
        if isinstance(positions, int):
            bit = rng.integers(0, positions, rows.size)
        else:
            bit = positions[rows, rng.integers(0, positions.shape[1], rows.size)]
        mask[rows] |= np.uint64(1) << bit.astype(np.uint64)
    return mask


def clustered_hashes(n: int, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Hashes clustered as real pHashes are (see the module docstring), and their shares."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
    order = rng.permutation(n)
    num_blank, num_templated, num_copies = n // 50, n // 20, 3 * n // 100
    blank = order[:num_blank]
    flat = np.array([0, 2**63, 2**64 - 1, 0x00FF00FF00FF00FF], np.uint64)
    noisy = np.broadcast_to(rng.choice(64, 16, replace=False), (num_blank, 16))
    hashes[blank] = flat[rng.integers(0, 4, num_blank)] ^ flips(rng, num_blank, noisy, 3)
    sizes = np.minimum(rng.zipf(1.8, num_templated), 5000)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), num_templated)]
    group = np.repeat(np.arange(sizes.size), sizes)
    templated = order[num_blank : num_blank + group.size]
    centers = rng.integers(0, 2**64, sizes.size, dtype=np.uint64)
    variable = np.argsort(rng.random((sizes.size, 64)), axis=1)[:, :20]
    hashes[templated] = centers[group] ^ flips(rng, group.size, variable[group], 6)
    copies = order[num_blank + group.size : num_blank + group.size + num_copies]
    hashes[copies] = hashes[rng.integers(0, n, copies.size)] ^ flips(rng, copies.size, 64, 4)
    shares = {"near_blank": num_blank, "templated": int(group.size), "templates": int(sizes.size)}
    return hashes, shares | {"copies": num_copies, "largest_template": int(sizes.max())}


def peak_rss_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def machine() -> dict:
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def bench_phash(args) -> dict:
    from tasks.curation import phash_dedup
    from tasks.curation.dedup import phash_losers

    def run(n: int) -> tuple[float, float, dict]:
        if args.clustered:
            hashes, shares = clustered_hashes(n)
        else:
            hashes, planted = planted_hashes(n, args.max_distance)
            shares = {"planted_near_copies": planted, "planted_blank": n // 200}
        rank = np.random.default_rng(1).permutation(n)
        start, cpu = time.perf_counter(), time.process_time()
        lost = phash_losers(hashes, rank, args.max_distance)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        blocks, tables = phash_dedup.plan(len(np.unique(hashes)), args.max_distance)
        info = shares | {"dropped": int(lost.sum()), "blocks": len(blocks), "tables": len(tables)}
        return seconds, cpu, info

    out: dict = {"bench": "dedup-phash", "rows": args.rows, "max_distance": args.max_distance}
    out["hashes"] = "clustered" if args.clustered else "uniform+planted"
    if args.clustered:
        small_s, small_cpu, small = run(args.rows // 10)
    load_before = os.getloadavg()[0]
    seconds, cpu, info = run(args.rows)
    out |= {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2)}
    out["rows_per_s"] = round(args.rows / seconds)
    if args.clustered:
        out |= {
            "seconds_rows_div_10": round(small_s, 2),
            "cpu_seconds_rows_div_10": round(small_cpu, 2),
            "growth_10x": round(seconds / small_s, 2),
            "growth_10x_cpu": round(cpu / small_cpu, 2),
            "plan_rows_div_10": {"blocks": small["blocks"], "tables": small["tables"]},
            "goals": PHASH_GOALS,
        }
    return out | info | {"peak_rss_gb": peak_rss_gb(), "load_avg_1m_before": load_before}


def clip_like(n: int, dim: int = 768, seed: int = 0, chunk: int = 50_000):
    """(embeddings fp16 [n, dim], planted pairs [P, 2] (copy, original), blob rows): see the
    module docstring. Made in chunks of `chunk` rows, copies within their chunk, so the first
    chunk is a complete sample of its own."""
    rng = np.random.default_rng(seed)

    def unit(v: np.ndarray) -> np.ndarray:
        return v / np.linalg.norm(v, axis=-1, keepdims=True)

    # Levels as CLIP's image space has them: a direction every image shares (random pairs
    # ~0.38), topics (~0.63) of Zipf-like sizes, subtopics of ~50 rows (~0.84), the row.
    shared = unit(rng.normal(size=dim)).astype(np.float32)
    num_topics = max(10, n // 2000)
    topic_p = 1 / (np.arange(num_topics) + 10.0) ** 1.1
    topic_p /= topic_p.sum()
    topics = unit(rng.normal(size=(num_topics, dim))).astype(np.float32)
    blob_centers = rng.normal(size=(10, dim)).astype(np.float32)
    x = np.empty((n, dim), np.float16)
    pairs, blobs = [], []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        subtopics = unit(rng.normal(size=(max(1, m // 50), dim))).astype(np.float32)
        topic = rng.choice(num_topics, m, p=topic_p)
        sub = rng.integers(0, len(subtopics), m)
        noise = unit(rng.normal(size=(m, dim)).astype(np.float32))
        part = unit(0.62 * shared + 0.5 * topics[topic] + 0.45 * subtopics[sub] + 0.4 * noise)
        copies = np.sort(rng.choice(np.arange(1, m), m // 25, replace=False))
        originals = (rng.random(copies.size) * copies).astype(np.int64)  # an earlier row
        misses = rng.choice(np.arange(1, m), m // 50, replace=False)
        blob = rng.choice(m, m // 200, replace=False)
        eps = unit(rng.normal(size=(m, dim)).astype(np.float32))
        for i, o in zip(copies, originals, strict=True):  # in order: copies of copies chain
            part[i] = unit(part[o] + rng.uniform(0.05, 0.30) * eps[i])
        for i in misses:
            part[i] = unit(part[rng.integers(0, i)] + rng.uniform(0.36, 0.5) * eps[i])
        center = unit(blob_centers[rng.integers(0, 10, blob.size)])
        part[blob] = unit(center + rng.uniform(0.02, 0.12, (blob.size, 1)) * eps[blob])
        x[start : start + m] = part
        pairs.append(np.stack([copies, originals], axis=1) + start)
        blobs.append(np.sort(blob) + start)
    return x, np.concatenate(pairs), np.concatenate(blobs)


def bench_semantic(args) -> dict:
    import torch

    from tasks.curation.semantic_dedup import Parts, SemanticIndex, screen

    threshold = 0.95
    start = time.perf_counter()
    x, pairs, blob = clip_like(args.rows, chunk=min(args.sample, args.rows))
    generate_s = time.perf_counter() - start
    device = torch.device(args.device or "cpu")
    rank = np.random.default_rng(1).permutation(args.rows)
    out = {"bench": "dedup-semantic", "rows": args.rows, "dim": x.shape[1], "device": str(device)}
    out["threshold"], out["screen_dtype"] = threshold, str(screen(device)[0])
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sdpipe-bench-semantic-") as work:
        start, cpu = time.perf_counter(), time.process_time()
        index = SemanticIndex(
            Parts.from_array(x), rank, threshold, device=device, workdir=Path(work)
        )
        build_s = time.perf_counter() - start
        lost = index.losers()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        again = time.perf_counter()
        index.losers(np.random.default_rng(2).random(args.rows) < 0.9)  # in sequence
        second_s = time.perf_counter() - again
        again = time.perf_counter()
        missed = index.estimate_missed()
        estimate_s = time.perf_counter() - again
        # Planted pairs that are duplicates (cosine >= threshold in float64) and meet in some
        # cluster: the only pairs the clustering could lose are those that do not.
        unit = x[pairs].astype(np.float64)
        unit /= np.linalg.norm(unit, axis=2, keepdims=True)
        true_pairs = pairs[np.sum(unit[:, 0] * unit[:, 1], axis=1) >= threshold]
        clusters = np.concatenate(
            [index.slot_cluster[index.primary_slot][:, None], _visited(index)], axis=1
        )
        a, b = clusters[true_pairs[:, 0]], clusters[true_pairs[:, 1]]
        meet = ((a[:, :, None] == b[:, None, :]) & (a[:, :, None] >= 0)).any(axis=(1, 2))
        out |= {
            "seconds": round(seconds, 1),
            "build_seconds": round(build_s, 1),
            "cpu_seconds": round(cpu, 1),
            "second_pass_seconds": round(second_s, 1),
            "rows_per_s": round(args.rows / seconds),
            "dropped": int(lost.sum()),
            "num_clusters": index.num_clusters,
            "visits": index.num_visits,
            # Rows with a centroid within reach that they do not visit, and of a sample of
            # them, those with a duplicate never compared with them (issue 26).
            "beyond_visits": index.beyond_visits,
            "missed_sampled": missed.sampled,
            "missed_sample": missed.missed_sample,
            "missed_estimate": missed.estimated,
            "estimate_seconds": round(estimate_s, 1),
            "largest_cluster": index.largest_cluster,
            # The most bytes the store's folder held while it was built (runs, then the store).
            "temp_bytes_per_row": round(index.temp_bytes / args.rows),
            "rounds": index.rounds,
            "planted_true_pairs": len(true_pairs),
            "planted_pairs_meeting": round(float(meet.mean()), 6),
        }
        del index
    out |= {"peak_rss_gb": peak_rss_gb(), "load_avg_1m_before": load_before}
    out |= agreement(x[: args.sample], pairs[pairs[:, 0] < args.sample], rank, device, threshold)
    out["generate_seconds"] = round(generate_s, 1)
    out["goals"] = SEMANTIC_GOALS
    return out


def _visited(index) -> np.ndarray:
    visited = np.full(index.visitor_slot.shape, -1, np.int64)
    has = index.visitor_slot >= 0
    visited[has] = index.slot_cluster[index.visitor_slot[has]]
    return visited


def agreement(x: np.ndarray, pairs: np.ndarray, rank: np.ndarray, device, threshold) -> dict:
    """The sample judged by clusters (default settings) and by all pairs (one cluster)."""
    from tasks.curation.semantic_dedup import Parts, SemanticIndex

    n = len(x)
    rank = np.argsort(np.argsort(rank[:n]))
    start = time.perf_counter()
    clustered = SemanticIndex(Parts.from_array(x), rank, threshold, device=device).losers()
    clustered_s = time.perf_counter() - start
    start = time.perf_counter()
    exact = SemanticIndex(
        Parts.from_array(x), rank, threshold, device=device, num_clusters=1
    ).losers()
    exact_s = time.perf_counter() - start
    planted = np.unique(pairs)
    return {
        "sample_rows": n,
        "sample_clusters": round(math.sqrt(n)),
        "agreement": round(float((clustered[planted] == exact[planted]).mean()), 6),
        "agreement_all_rows": round(float((clustered == exact).mean()), 6),
        "sample_dropped_clustered": int(clustered.sum()),
        "sample_dropped_all_pairs": int(exact.sum()),
        "sample_clustered_seconds": round(clustered_s, 1),
        "sample_all_pairs_seconds": round(exact_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-distance", type=int, default=4)
    parser.add_argument("--clustered", action="store_true")
    parser.add_argument("--semantic", action="store_true")
    parser.add_argument("--sample", type=int, default=50_000)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    out = bench_semantic(args) if args.semantic else bench_phash(args)
    print(json.dumps(out | machine()))


if __name__ == "__main__":
    main()
