"""Dedup throughput: pHash near-duplicates (banded join) over N hashes, and semantic blockwise.

The hashes are uniform 64-bit values plus what real data has: planted near copies (1% of rows,
up to k bits flipped) and one blank image repeated (0.5% of rows). The semantic part compares
every pair of `--semantic-rows` 768-d embeddings, block by block. Prints one JSON object.
Usage: python bench/dedup.py [--rows N] [--max-distance K] [--semantic-rows M] [--device D]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import platform
import time

import numpy as np


def planted_hashes(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """(hashes, number of planted near copies)."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
    copies = rng.choice(n, n // 100, replace=False)
    originals = rng.integers(0, n, copies.size)
    for row, original in zip(copies, originals, strict=True):
        bits = rng.choice(64, rng.integers(0, k + 1), replace=False).astype(np.uint64)
        flip = np.bitwise_or.reduce(np.uint64(1) << bits) if bits.size else np.uint64(0)
        hashes[row] = hashes[original] ^ flip
    hashes[rng.choice(n, n // 200, replace=False)] = 0  # a blank image, many times over
    return hashes, copies.size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-distance", type=int, default=4)
    parser.add_argument("--semantic-rows", type=int, default=20_000)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    from tasks import dedup

    hashes, num_planted = planted_hashes(args.rows, args.max_distance)
    rank = np.random.default_rng(1).permutation(args.rows)
    start = time.perf_counter()
    lost = dedup.phash_losers(hashes, rank, args.max_distance)
    seconds = time.perf_counter() - start

    rng = np.random.default_rng(2)
    emb = rng.normal(size=(args.semantic_rows, 768)).astype(np.float16)
    emb[1::50] = emb[::50][: emb[1::50].shape[0]]  # 2% exact semantic copies
    start = time.perf_counter()
    sem_lost = dedup.semantic_losers(emb, np.arange(args.semantic_rows), 0.95, device=args.device)
    semantic_seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "bench": "dedup",
                "rows": args.rows,
                "max_distance": args.max_distance,
                "seconds": round(seconds, 2),
                "rows_per_s": round(args.rows / seconds),
                "dropped": int(lost.sum()),
                "planted_near_copies": num_planted,
                "planted_blank": args.rows // 200,
                "semantic_rows": args.semantic_rows,
                "semantic_seconds": round(semantic_seconds, 2),
                "semantic_dropped": int(sem_lost.sum()),
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
