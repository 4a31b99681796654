"""filter-pixels throughput: a profile + exact dedup over every fetched shard of a source, and the
kept rows split back into one `selected/NNNNN.parquet` per shard.

Writes N fetched-shard sample tables as fetch-images leaves them (the metadata row's columns +
fetched width, height, sha256, status; 2% failed downloads, 3% repeated image bytes) into a
temporary data root, then times `tasks.curation.filter_pixels.select_pixels` with the recipe's
phase-1 profile (laion-broad: scores, size, key/url/sha256 dedup), best of R, and the process's
peak RSS. Prints one JSON object.
Usage: python bench/filter_pixels.py [--shards N] [--rows-per-shard M] [--repeat R]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import multiprocessing
import os
import platform
import resource
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_shards(folder: Path, num_shards: int, rows: int, seed: int = 0) -> int:
    """Fetched-shard sample tables; returns the number of successfully fetched rows."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    n = num_shards * rows
    digest = rng.integers(0, 2**63, n).astype(str)
    copies = np.flatnonzero(rng.random(n) < 0.03)
    digest[copies] = digest[(rng.random(copies.size) * copies).astype(np.int64)]
    ok = rng.random(n) >= 0.02
    for s in range(num_shards):
        part = slice(s * rows, (s + 1) * rows)
        keys = np.char.add(f"{s:05d}", np.char.zfill(np.arange(rows).astype(str), 7))
        table = pa.table(
            {
                "key": keys,
                "url": np.char.add("https://img.example.com/", np.char.add(keys, ".jpg")),
                "caption": np.char.add("a photo, sample ", keys),
                "similarity": rng.normal(0.31, 0.035, rows),
                "punsafe": rng.beta(0.4, 8, rows),
                "pwatermark": rng.beta(0.7, 3, rows),
                "aesthetic": rng.normal(7.0, 0.5, rows),
                "source": ["laion"] * rows,
                "width": rng.integers(512, 1600, rows),
                "height": rng.integers(512, 1600, rows),
                "sha256": digest[part],
                "status": np.where(ok[part], "success", "http_404"),
            }
        )
        pq.write_table(table, folder / f"{s:05d}.parquet")
    return int(ok.sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--rows-per-shard", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from catalog import load_catalog
    from tasks.curation import filter_pixels

    profile = load_catalog().profile("laion-broad")
    root = Path(tempfile.mkdtemp(prefix="sdpipe-bench-filter-pixels-"))
    try:
        # Written by a child process, so this one's peak RSS is the stage's alone.
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=spawn) as child:
            folder = root / "laion" / "shards"
            fetched = child.submit(write_shards, folder, args.shards, args.rows_per_shard).result()
        runs = []
        for _ in range(args.repeat):
            shutil.rmtree(root / "laion" / "selected", ignore_errors=True)
            start = time.perf_counter()
            stats = filter_pixels.select_pixels(root, "laion", profile)
            runs.append(time.perf_counter() - start)
        written = sorted((root / "laion" / "selected").glob("[0-9]*.parquet"))
        rows_written = sum(pq.read_metadata(p).num_rows for p in written)
        if len(written) != args.shards or rows_written != stats.num_out:
            raise SystemExit(f"{len(written)} shards, {rows_written} rows for {stats.num_out}")
    finally:
        shutil.rmtree(root)
    best = min(runs)
    print(
        json.dumps(
            {
                "bench": "filter_pixels",
                "shards": args.shards,
                "rows": args.shards * args.rows_per_shard,
                "fetched": fetched,
                "profile": profile.name,
                "seconds": round(best, 3),
                "seconds_all": [round(s, 3) for s in runs],
                "rows_per_s": round(fetched / best),
                "kept": stats.num_out,
                "dropped": stats.dropped,
                # this process at its peak: DuckDB (capped by its memory_limit) and what the
                # stage holds in Python and Arrow (the kept rows, the dedup arrays)
                "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
