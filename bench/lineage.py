"""Lineage at scale: a phase set of N rows (a run's copy of its rows: key, source, url, caption
as Arrow stand-ins, no latents) and ten checkpoints of one run, 1M rows drawn between each
(8 ranks x 125 rows, 1,000 held out); the lineage of the first (its 1M rows to parquet), and a
reverse query of 10,000 URLs (half drawn, half not) over the ten. Each query runs in a fresh
process: its seconds and peak RSS are its own. Prints JSON lines; the last carries `seconds`
(the slower query) and `peak_rss_gb`.

    python bench/lineage.py --rows 10000000 [--copy zstd|plain] [--cold] [--dir D] [--keep]
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
import resource
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pyarrow as pa

from sdtrain.data import split_rows
from sdtrain.lineage import (
    BATCH_ROWS,
    COPY_OPTIONS,
    Segment,
    copy_schema,
    keep_held_out,
    set_copy,
)

DIGEST = "0" * 64  # the stand-in set's digest
RANKS, BATCH, NUM_VAL = 8, 125, 1000
PER_CHECKPOINT = 1_000_000  # rows drawn between checkpoints
NUM_CHECKPOINTS = 10
NUM_URLS = 10_000


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """uint8 [n, width]: the values as zero-padded ASCII digits."""
    out = np.empty((len(values), width), np.uint8)
    rest = values.astype(np.int64)
    for i in range(width - 1, -1, -1):
        out[:, i] = 48 + rest % 10
        rest //= 10
    return out


def _text(parts: list, n: int) -> pa.Array:
    """Fixed-width strings of n rows from literal pieces (str) and digit columns."""
    columns = [
        np.broadcast_to(np.frombuffer(p.encode(), np.uint8), (n, len(p)))
        if isinstance(p, str)
        else p
        for p in parts
    ]
    data = np.ascontiguousarray(np.concatenate(columns, axis=1))
    width = data.shape[1]
    offsets = np.arange(n + 1, dtype=np.int32) * width
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data.reshape(-1)))


def urls_of(rows: np.ndarray) -> pa.Array:
    rows = np.asarray(rows, np.int64)
    n = len(rows)
    mixed = (rows * 2654435761) % 10**10
    return _text(
        ["https://img", _digits(rows % 1000, 3), ".example.com/", _digits(mixed, 10), "/",
         _digits(rows, 10), ".jpg"],
        n,
    )  # fmt: skip


def build(directory: Path, num_rows: int, plain: bool = False) -> None:
    """The copy as the trainer keeps it (`keep_set`, `keep_held_out`), or with `plain` as sdpipe
    kept it before (uncompressed, source as plain strings, no held-out rows)."""
    run = directory / "runs" / "phase-1"
    copy = set_copy(run, DIGEST)
    copy.parent.mkdir(parents=True, exist_ok=True)
    schema = copy_schema(bucketed=False)
    sources = pa.array(["laion"])
    if plain:
        schema = schema.set(1, pa.field("source", pa.string()))
    else:
        keep_held_out(copy, 0, split_rows(num_rows, NUM_VAL, 0)[1])
    options = None if plain else COPY_OPTIONS
    with (
        pa.OSFile(str(copy), "wb") as sink,
        pa.ipc.new_file(sink, schema, options=options) as writer,
    ):
        for start in range(0, num_rows, BATCH_ROWS):
            rows = np.arange(start, min(start + BATCH_ROWS, num_rows), dtype=np.int64)
            n = len(rows)
            key = _text(["laion/", _digits(rows // 10_000, 6), "/", _digits(rows, 10)], n)
            source = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), sources)
            source = source.dictionary_decode() if plain else source
            caption = _text(["a photo of object ", _digits(rows, 10), " on a table"], n)
            writer.write_batch(
                pa.record_batch([key, source, urls_of(rows), caption], schema=schema)
            )
    per_epoch = ((num_rows - NUM_VAL) // RANKS) // BATCH  # micro-batches an epoch
    for k in range(1, NUM_CHECKPOINTS + 1):
        steps = k * PER_CHECKPOINT // (RANKS * BATCH)
        epoch, within = divmod(steps, per_epoch)
        segment = Segment(
            set=DIGEST, phase_dir="", sampler="epoch", seed=0, world_size=RANKS,
            batch_size=BATCH, grad_accum=1, num_rows=num_rows, num_val=NUM_VAL, first_step=0,
            last_step=steps, start=(0, 0), end=(epoch, within * RANKS * BATCH),
        )  # fmt: skip
        folder = run / "checkpoints" / f"step-{steps:06d}"
        folder.mkdir(parents=True)
        (folder / "lineage.json").write_text(json.dumps({"segments": [segment.to_json()]}))


def evict(directory: Path) -> None:
    """The copy's pages out of the page cache (this file only), as on a machine whose cache
    cannot hold it."""
    for path in (directory / "runs").rglob("lineage/*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def query(directory: Path, what: str, num_rows: int, cold: bool = False) -> dict:
    from tasks.phases import lineage

    if cold:
        evict(directory)

    if what == "lineage":
        started = time.perf_counter()
        first = lineage.checkpoints(directory)[0]
        count = lineage.write_lineage(first, directory / "lineage.parquet")
        result = {"query": "lineage", "rows_listed": count}
    else:
        # The URLs asked: half drawn by the last checkpoint, half any row's (outside the time).
        rng = np.random.default_rng(7)
        drawn = lineage.drawn_by_set(lineage.checkpoints(directory)[-1])[0][2]
        wanted = np.concatenate(
            [rng.choice(drawn, NUM_URLS // 2, replace=False), rng.integers(0, num_rows, 5000)]
        )
        urls = urls_of(wanted)
        del drawn
        started = time.perf_counter()
        found = lineage.who_saw(directory, urls=urls)
        result = {
            "query": "reverse",
            "urls": NUM_URLS,
            "checkpoints_found": len(found),
            "rows_seen_by_last": found[-1]["num_rows"] if found else 0,
        }
    result["seconds"] = round(time.perf_counter() - started, 2)
    result["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--copy", choices=["zstd", "plain"], default="zstd",
        help="the copy as the trainer keeps it, or as sdpipe kept it before (for comparison)",
    )  # fmt: skip
    parser.add_argument("--cold", action="store_true", help="the copy out of the page cache first")
    parser.add_argument("--query", choices=["lineage", "reverse"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.query:
        print(json.dumps(query(args.dir, args.query, args.rows, args.cold)), flush=True)
        return
    directory = args.dir or Path(tempfile.mkdtemp(prefix="lineage-bench-"))
    try:
        started = time.perf_counter()
        build(directory, args.rows, plain=args.copy == "plain")
        copy_gb = set_copy(directory / "runs" / "phase-1", DIGEST).stat().st_size / 2**30
        built = {"built_s": round(time.perf_counter() - started, 1), "rows": args.rows}
        print(json.dumps({**built, "copy_gb": round(copy_gb, 2)}), flush=True)
        results = []
        for what in ("lineage", "reverse"):
            out = subprocess.run(
                [sys.executable, __file__, "--query", what, "--dir", str(directory),
                 "--rows", str(args.rows), *(["--cold"] if args.cold else [])],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
        print(
            json.dumps(
                {
                    "bench": "lineage",
                    "rows": args.rows,
                    "copy": args.copy,
                    "cold": args.cold,
                    "checkpoints": NUM_CHECKPOINTS,
                    "lineage_s": results[0]["seconds"],
                    "reverse_s": results[1]["seconds"],
                    "seconds": max(r["seconds"] for r in results),
                    "peak_rss_gb": max(r["peak_rss_gb"] for r in results),
                }
            )
        )
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
