"""filter-pixels' pHash level through the partitioned hook (`dedup.mark(phash=)`): what the
flow's process holds. A DuckDB table `passing` of N rows (3% exact pHash copies, 20% already
dropped by a rule) is marked once through the partitioned hook, its rows streamed to it in
batches (`partitioned`: the stage's path past SDPIPE_PHASH_TASK_ROWS), and once by the level in
this process over every row's arrays (`in_process`: `NearHashes`, the one-node path), each in a
fresh process, DuckDB capped as the stage caps it; per path the wall time and what the level
held outside DuckDB at its peak (numpy and Python objects by tracemalloc, Arrow's pool by its
own peak), per row; the process's peak RSS beside (DuckDB's own memory, capped, sets it here).
Prints one JSON object.
Usage: python bench/phash_level.py [--rows N] [--workers W] [--duckdb-memory 1GB]
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
import resource
import subprocess
import tempfile
import time
import tracemalloc

import pyarrow as pa


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def one(path: str, rows: int, workers: int) -> dict:
    """Mark the level in this process by `path`; its numbers. DuckDB as the stage has it
    (`duck.connect`: its memory capped by SDPIPE_DUCKDB_MEMORY, spilling under the root)."""
    from catalog import FilterProfile
    from tasks.curation import dedup, duck
    from tasks.curation import phash_partitioned as pp
    from tasks.curation.partition_files import LocalProcesses

    with tempfile.TemporaryDirectory(prefix="sdpipe-bench-phash-level-") as work:
        con = duck.connect(Path(work))
        con.sql(f"""
            CREATE TABLE passing AS SELECT lpad(i::VARCHAR, 12, '0') AS key,
                hash(i % {int(rows * 0.97)})::UBIGINT AS phash, 256 + i % 512 AS width,
                256 + i % 384 AS height, (i % 1000) / 100.0 AS aesthetic,
                CASE WHEN hash(i + 7) % 5 = 0 THEN 'too_small' END AS reason
            FROM range({rows}) t(i)
        """)
        table_gb = peak_gb()
        profile = FilterProfile(name="bench", dedup=("phash",), phash_distance=4)
        hook = None  # in_process: NearHashes over every row's arrays
        if path == "partitioned":
            hook = pp.PartitionedLosers(LocalProcesses(workers), Path(work) / "partitions")
        arrow = pa.default_memory_pool()
        arrow_before = arrow.bytes_allocated()
        tracemalloc.start()  # numpy's arrays and Python's objects; Arrow's pool beside it
        start = time.perf_counter()
        alone, removed = dedup.mark(con, profile, "phash", None, phash=hook)
        seconds = time.perf_counter() - start
        held = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        con.close()
    peak = peak_gb()
    return {
        "seconds": round(seconds, 2),
        "alone": alone,
        "removed": removed,
        # what the level held outside DuckDB (whose memory the stage caps): its peak
        "held_numpy_python_mb": round(held / 2**20, 1),
        "held_arrow_max_mb": round((arrow.max_memory() - arrow_before) / 2**20, 1),
        "peak_rss_gb": round(peak, 3),
        "table_rss_gb": round(table_gb, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duckdb-memory", default="1GB", help="SDPIPE_DUCKDB_MEMORY")
    parser.add_argument("--path", choices=("partitioned", "in_process"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["SDPIPE_DUCKDB_MEMORY"] = args.duckdb_memory
    if args.path:  # one path, in this fresh process
        print(json.dumps(one(args.path, args.rows, args.workers)))
        return
    out = {"bench": "phash_level", "rows": args.rows, "workers": args.workers}
    out["duckdb_memory"] = args.duckdb_memory
    for path in ("in_process", "partitioned"):
        command = [sys.executable, __file__, "--rows", str(args.rows), "--path", path]
        done = subprocess.run(
            command + ["--workers", str(args.workers)], capture_output=True, text=True, check=True
        )
        out[f"{path}_path"] = json.loads(done.stdout.strip().splitlines()[-1])
    new, old = out["partitioned_path"], out["in_process_path"]
    out["same_marks"] = all(new[k] == old[k] for k in ("alone", "removed"))
    held = {
        k: v["held_numpy_python_mb"] + max(0, v["held_arrow_max_mb"])
        for k, v in (("partitioned", new), ("in_process", old))
    }
    out["held_bytes_per_row"] = {k: round(v * 2**20 / args.rows, 1) for k, v in held.items()}
    out["machine"] = f"{platform.machine()} {os.cpu_count()} cores"
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
