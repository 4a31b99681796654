"""Control-path bench: the per-shard bookkeeping of a stage over many tiny shards (issue 26.5).

No model, no pixels: each shard's "work" writes two tiny outputs (`NNNNN.npy` token ids and
`NNNNN.parquet`, each through `atomic_path`) so that what is timed is the shard contract around
it: the done check, cleaning the shard's temporaries, the stats record (with its outputs), the
progress watcher's poll (one per shard: a shard finishing every second), and, at the end of the
first and the last block, `sdpipe status` of the source and opening a phase set of every shard
so far, each divided by the shards it covers.

Per shard cost must not grow with the number of shards: `ratio` = last block / first block
(acceptance: <= 1.5 at 10,000 shards).

    .venv/bin/python bench/control_path.py [--shards 10000] [--block 1000] [--root DIR]

The data root is a temporary folder under --root (default /dev/shm, a RAM file system: the
atomic writes' fsyncs cost a real disk some ms per shard whatever the shard count, and would
only dilute what grows), removed at the end.

Prints one JSON object on one line, last.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from flows.cli.progress import Watcher  # noqa: E402
from flows.cli.status import format_status, status  # noqa: E402
from sdtrain import layout  # noqa: E402
from sdtrain.atomic import atomic_path  # noqa: E402
from sdtrain.data import PhaseSet  # noqa: E402
from tasks.runtime.shards import ShardStats, run_shard, shard_name  # noqa: E402

SOURCE, STAGE = "bench", "tokens"
ROWS_PER_SHARD = 2


def work(root: Path, shard: str):
    ids = np.full((ROWS_PER_SHARD, 77), 49407, np.int32)

    def run(stats: ShardStats) -> None:
        folder = root / SOURCE / STAGE
        with atomic_path(folder / f"{shard}.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, ids)
        with atomic_path(folder / f"{shard}.parquet") as tmp:
            tmp.write_bytes(b"PAR1" * 4)  # not read by anything timed here
        stats.num_in = stats.num_out = ROWS_PER_SHARD

    return run


def phase_set(root: Path, n: int, latent: Path) -> Path:
    """A phase set of the first `n` shards as mix lays it out: manifest, index, links."""
    folder = root / "phases" / f"bench-{n}"
    (folder / "latents").mkdir(parents=True)
    (folder / "tokens").mkdir()
    names = [layout.file_name(SOURCE, shard_name(i)) for i in range(n)]
    for i, name in enumerate(names):
        (folder / "latents" / f"{name}.npy").symlink_to(latent)
        (folder / "tokens" / f"{name}.npy").symlink_to(
            root / SOURCE / STAGE / f"{shard_name(i)}.npy"
        )
    files = np.repeat(np.arange(n, dtype=np.int32), ROWS_PER_SHARD)
    within = np.tile(np.arange(ROWS_PER_SHARD, dtype=np.int32), n)
    manifest = pa.table(
        {
            "source": pa.array([SOURCE] * len(files)),
            "shard": pa.array([shard_name(int(f)) for f in files]),
            "latent_row": pa.array(within),
            "token_row": pa.array(within),
            "key": pa.array([f"{int(f)}-{int(r)}" for f, r in zip(files, within, strict=True)]),
        }
    )
    pq.write_table(manifest, folder / layout.MANIFEST)
    layout.write_index(folder, names, np.stack([files, within, within], axis=1))
    return folder


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--block", type=int, default=1_000)
    ap.add_argument(
        "--root",
        type=Path,
        default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
        help="where the temporary data root goes (default /dev/shm: the bookkeeping's CPU and "
        "file-system calls, not the disk's fsync latency, which is the same for every shard)",
    )
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="control-path-", dir=args.root))
    try:
        # The filter's shards: what status and the watcher count the todo shards from.
        filtered = root / SOURCE / "filtered"
        filtered.mkdir(parents=True)
        for i in range(args.shards):
            (filtered / f"{shard_name(i)}.parquet").touch()
        latent = root / "latent.npy"
        np.save(latent, np.zeros((ROWS_PER_SHARD, 4, 8, 8), np.float16))
        watcher = Watcher(root, sources=[SOURCE])
        watcher.poll()
        per_shard = np.zeros(args.shards)
        record_s = np.zeros(args.shards)
        poll_s = np.zeros(args.shards)
        amortized: dict[int, dict[str, float]] = {}
        checkpoints = {args.block, args.shards}
        for i in range(args.shards):
            shard = shard_name(i)
            record_s[i] = timed(lambda s=shard: run_shard(root, SOURCE, STAGE, s, work(root, s)))
            poll_s[i] = timed(watcher.poll)
            per_shard[i] = record_s[i] + poll_s[i]
            n = i + 1
            if n in checkpoints:
                status_s = timed(lambda: format_status(status(root, [SOURCE])))
                folder = phase_set(root, n, latent)
                start = time.perf_counter()
                opened = PhaseSet(folder)
                open_s = time.perf_counter() - start
                assert len(opened) == n * ROWS_PER_SHARD
                amortized[n] = {
                    "status_ms": status_s / n * 1e3,
                    "phase_set_open_ms": open_s / n * 1e3,
                }
            if n % args.block == 0:
                print(
                    f"{n} shards: {per_shard[n - args.block : n].mean() * 1e3:.3f} ms/shard",
                    file=sys.stderr,
                    flush=True,
                )
        lines = watcher.poll()
        assert any(line.done == args.shards for line in lines), [line.text() for line in lines]
        b = args.block
        first = per_shard[:b].mean() * 1e3 + sum(amortized[b].values())
        last = per_shard[-b:].mean() * 1e3 + sum(amortized[args.shards].values())
        result = {
            "bench": "control_path",
            "shards": args.shards,
            "block": b,
            "per_shard_ms_first_1000": round(first, 4),
            "per_shard_ms_last_1000": round(last, 4),
            "ratio": round(last / first, 3),
            "record_ms_first": round(record_s[:b].mean() * 1e3, 4),
            "record_ms_last": round(record_s[-b:].mean() * 1e3, 4),
            "progress_poll_ms_first": round(poll_s[:b].mean() * 1e3, 4),
            "progress_poll_ms_last": round(poll_s[-b:].mean() * 1e3, 4),
            # Medians: what a shard costs with the spikes of a shared machine left out.
            "per_shard_ms_median_first": round(statistics.median(per_shard[:b]) * 1e3, 4),
            "per_shard_ms_median_last": round(statistics.median(per_shard[-b:]) * 1e3, 4),
            "record_ms_median_first": round(statistics.median(record_s[:b]) * 1e3, 4),
            "record_ms_median_last": round(statistics.median(record_s[-b:]) * 1e3, 4),
            "poll_ms_median_first": round(statistics.median(poll_s[:b]) * 1e3, 4),
            "poll_ms_median_last": round(statistics.median(poll_s[-b:]) * 1e3, 4),
            "status_ms_per_shard": {str(k): round(v["status_ms"], 4) for k, v in amortized.items()},
            "phase_set_open_ms_per_shard": {
                str(k): round(v["phase_set_open_ms"], 4) for k, v in amortized.items()
            },
            "total_s": round(float(per_shard.sum()), 2),
            "cpus": os.cpu_count(),
            "root": str(args.root),
        }
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(root)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
