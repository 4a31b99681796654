"""`sdpipe remove` over a stand-in source: 1% of --rows rows over --shards shards, taken back
once clustered in 5% of the shards (a domain's takedown) and once spread over all of them.

Each shard has small stand-in files of every kind the removal reads by key or by position:
a metadata table (key, url, hash), a fetched-shard table (key, url, sha256, status), a latents
file (fp16 [n, 4]) and its keys file. Generating them is not timed; `seconds` is the removal
(plan, then the rewrites), `shards_rewritten` the shards it rewrote. Prints one JSON line per
case, the last with both.
Usage: python bench/remove.py [--rows 10000000] [--shards 1000] [--workdir DIR]
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
import pyarrow as pa
import pyarrow.parquet as pq
from dedup import machine, peak_rss_gb

from catalog import FilterProfile
from tasks.removal import apply, lists


def build(root: Path, rows: int, shards: int) -> None:
    per = rows // shards
    d = root / "standin"
    for sub in ("metadata", "shards", "latents"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        name = f"{s:05d}"
        keys = pa.array([f"{name}{i:07d}" for i in range(per)], pa.string())
        urls = pa.array([f"http://h{s % 97}.example/{s}/{i}.jpg" for i in range(per)])
        hashes = pa.array(np.arange(s * per, (s + 1) * per, dtype=np.int64))
        pq.write_table(
            pa.table({"key": keys, "url": urls, "hash": hashes}), d / "metadata" / f"{name}.parquet"
        )
        sha = pa.array([f"{s:08x}{i:056x}" for i in range(per)])
        status = pa.array(["success"] * per)
        pq.write_table(
            pa.table({"key": keys, "url": urls, "sha256": sha, "status": status}),
            d / "shards" / f"{name}.parquet",
        )
        np.save(d / "latents" / f"{name}.64x64.npy", np.ones((per, 4), np.float16))
        table = pa.table(
            {
                "key": keys,
                "token_row": pa.array(np.arange(per, dtype=np.int32)),
                "bucket": pa.array(["64x64"] * per),
                "bucket_row": pa.array(np.arange(per, dtype=np.int32)),
            }
        )
        keys_file = d / "latents" / f"{name}.keys.arrow"
        with pa.OSFile(str(keys_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table)


def case(workdir: Path, rows: int, shards: int, clustered: bool) -> dict:
    root = workdir / ("clustered" if clustered else "spread")
    shutil.rmtree(root, ignore_errors=True)
    build(root, rows, shards)
    per, n = rows // shards, rows // 100
    rng = np.random.default_rng(0)
    if clustered:  # 5% of the shards, n rows among them
        chosen = rng.choice(shards, max(1, shards // 20), replace=False)
        picks = rng.choice(len(chosen) * per, n, replace=False)
        pairs = [(int(chosen[p // per]), int(p % per)) for p in picks]
    else:
        picks = rng.choice(rows - rows % shards, n, replace=False)
        pairs = [(int(p // per), int(p % per)) for p in picks]
    list_file = root / "takedown.txt"
    list_file.write_text("".join(f"{s:05d}{i:07d}\n" for s, i in pairs))
    start = time.perf_counter()
    record = apply.remove(
        root, "standin", lists.read_list(list_file), FilterProfile(name="bench"), scored=False
    )
    seconds = time.perf_counter() - start
    rewritten = {Path(f).name.split(".")[0] for f in record["files_rewritten"]}
    return {
        "case": "clustered" if clustered else "spread",
        "rows": rows,
        "shards": shards,
        "rows_removed": record["num_rows"],
        "seconds": round(seconds, 2),
        "shards_rewritten": len(rewritten),
        "files_rewritten": len(record["files_rewritten"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-remove-"))
    try:
        results = {}
        for clustered in (True, False):
            result = case(workdir, args.rows, args.shards, clustered)
            print(json.dumps(result), flush=True)
            results[result["case"]] = result
        print(json.dumps({**results, **machine(), "peak_rss_gb": peak_rss_gb()}))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
