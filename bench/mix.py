"""Mix and the phase set at scale: a manifest of N samples over S shards, opened by 2 ranks.

Inputs are generated, not timed: one source of S encoded shards (~1.02 N / S rows each) as
encode and tokenize leave them (keys file `latents/NNNNN.keys.arrow`, stats record without
keys, latents and token ids .npy, a key-only tokens parquet), and a dataset view keeping 99%
of the keys (`views/<dataset>.parquet`, shard + key, with its record). The .npy files are sparse
at their full size (SD1.5 latents [4, 64, 64] fp16 by default): mix and opening a phase set
never read them, and a rank's few batches read holes.

Timed: `tasks.phases.mix.build_phase_set` in a fresh process (view read, encoded keys read and
joined a shard at a time, the seeded draw of N, manifest + row index + links written), then 2 rank
processes started at once, each importing the trainer's data module and opening
`sdtrain.data.PhaseSet`. `seconds` = mix + start of the ranks until the later one has opened.
Each rank then reads a few batches through `EpochSampler` and a `DataLoader`, as training does.

Memory beyond the mapped files: a rank's `RssAnon` from /proc/self/status (anonymous pages:
the heap, Python and torch; file pages of the mapped latents, tokens and row index are
`RssFile` and live once in the page cache), sampled every 10 ms from start to its last batch:
`rss_per_rank_gb` is the larger rank's peak. Inputs are warm in the page cache (just written).
With `--buckets K`, the shards are encoded in K aspect buckets (the first K <= 33 of a 1024² plan,
rows spread over them unevenly: keys file with bucket and bucket_row, a sparse latents file per
shard and bucket): timed are `tasks.phases.plan.plan_phase` (8 ranks) and the mix, in one process;
the ranks are not started (the bucketed sampler is not part of this bench).
Prints one JSON object, last.
Usage: python bench/mix.py [--rows N] [--shards S] [--resolution PX] [--batches B] [--dir D]
       [--buckets K] [--keep]
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
import shutil
import subprocess
import tempfile
import threading
import time

GOALS = {"seconds": 60, "rss_per_rank_gb": 2}  # at 100M rows over 10k shards
SOURCE, DATASET, PHASE = "synth", "synth-all", "bench"
DROP_EVERY = 100  # the view drops one key in 100


def catalog(root: Path, rows: int, resolution: int):
    from catalog import Catalog, Dataset, FilterProfile, MixEntry, Model, Phase, Source

    phase = Phase(
        name=PHASE, mix=(MixEntry(dataset=DATASET, count=rows),), model="sd", lr=1e-5,
        warmup_steps=0, epochs=1, cfg_dropout=0.1, min_snr_gamma=5.0, batch_size=32,
    )  # fmt: skip
    return Catalog(
        sources={SOURCE: Source(name=SOURCE, kind="url", location="x", license="x", profile="p")},
        profiles={"p": FilterProfile(name="p")},
        datasets={DATASET: Dataset(name=DATASET, source=SOURCE, profile="p")},
        phases={PHASE: phase},
        models={"sd": Model(name="sd", resolution=resolution, unet_config={"x": 1})},
        directory=root,
    )


def rows_per_shard(rows: int, shards: int) -> int:
    return math.ceil(rows * 1.02 / shards)


def bucket_columns(per_shard: int, buckets: int, seed: int):
    """(bucket names, name of each row's bucket: a string column, bucket_row int32 column) of
    one shard's rows spread over `buckets` buckets with weights 1, 1/2, 1/3, ..."""
    import numpy as np
    import pyarrow as pa

    from catalog.buckets import BucketPlan

    names = BucketPlan(area=1024 * 1024, max_side=2048, max_aspect=4.0).names()[:buckets]
    weights = 1 / np.arange(1, len(names) + 1)
    codes = np.random.default_rng(seed).choice(len(names), per_shard, p=weights / weights.sum())
    order = np.argsort(codes, kind="stable")
    starts = np.searchsorted(codes[order], np.arange(len(names)))
    bucket_row = np.empty(per_shard, np.int32)
    bucket_row[order] = np.arange(per_shard) - starts[codes[order]]
    column = pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), names)
    counts = np.bincount(codes, minlength=len(names))
    return names, counts, column.cast(pa.string()), pa.array(bucket_row)


def generate(root: Path, rows: int, shards: int, resolution: int, buckets: int = 0) -> None:
    """The encoded source and its view (see the module docstring)."""
    from dataclasses import asdict

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from sdtrain.atomic import write_json_atomic
    from tasks.curation import views
    from tasks.latents import latent_keys
    from tasks.runtime.shards import ShardStats, stats_path

    per_shard = rows_per_shard(rows, shards)
    width = len(str(per_shard))
    side = resolution // 8
    for sub in ("latents", "tokens", "views"):
        (root / SOURCE / sub).mkdir(parents=True, exist_ok=True)
    view_path = views.view_paths(root, SOURCE, DATASET)["keys"]
    view_schema = pa.schema([("shard", pa.string()), ("key", pa.string())])
    index = np.arange(per_shard)
    suffix = pc.utf8_lpad(pa.array(index).cast(pa.string()), width, "0")
    view_rows = pa.array(index % DROP_EVERY != 42)
    pending = []
    with pq.ParquetWriter(view_path, view_schema) as view:
        for s in range(shards):
            shard = f"{s:05d}"
            keys = pc.binary_join_element_wise(shard, suffix, "")
            tokens = root / SOURCE / "tokens" / f"{shard}.parquet"
            pq.write_table(pa.table({"key": keys}), tokens)
            for path, shape, dtype in (
                (root / SOURCE / "tokens" / f"{shard}.npy", (per_shard, 77), np.int32),
                (
                    root / SOURCE / "latents" / f"{shard}.npy",
                    (per_shard, 4, side, side),
                    np.float16,
                ),
            ):  # sparse: the header, then a hole to the full size
                del_me = np.lib.format.open_memmap(path, "w+", dtype, shape)
                del del_me
            table = latent_keys.table(keys, index, tokens)
            if buckets:
                names, counts, column, bucket_row = bucket_columns(per_shard, buckets, s)
                table = table.append_column("bucket", column)
                table = table.append_column("bucket_row", bucket_row)
                spec = {"vae": "bench", "plan": {}, "views": 1, "channels": 4}
                table = table.replace_schema_metadata(
                    {**table.schema.metadata, latent_keys.SPEC_KEY: json.dumps(spec).encode()}
                )
                for name, count in zip(names, counts.tolist(), strict=True):
                    w, h = (int(x) // 8 for x in name.split("x"))
                    path = root / SOURCE / "latents" / f"{shard}.{name}.npy"
                    del_me = np.lib.format.open_memmap(path, "w+", np.float16, (count, 1, 4, h, w))
                    del del_me
            with (
                pa.OSFile(str(latent_keys.path(root, SOURCE, shard)), "wb") as f,
                pa.ipc.new_file(f, table.schema) as writer,
            ):
                writer.write_table(table)
            record = ShardStats(
                stage="latents", source=SOURCE, shard=shard, num_in=per_shard, num_out=per_shard
            )
            record.extra = {"model": "sd"}
            stats_path(root, SOURCE, "latents", shard).write_text(json.dumps(asdict(record)))
            kept = keys.filter(view_rows)
            pending.append(pa.table({"shard": pa.array([shard] * len(kept)), "key": kept}))
            if sum(t.num_rows for t in pending) >= 1 << 20 or s == shards - 1:
                # row groups of ~1M rows, as pq.write_table writes a real view's
                view.write_table(pa.concat_tables(pending).combine_chunks())
                pending = []
    record = ShardStats(stage="views", source=SOURCE, shard=DATASET)
    record.extra = {
        "fingerprint": views.fingerprint(root, catalog(root, rows, resolution), DATASET),
        "profile": "p",
        "dataset": DATASET,
    }
    record.outputs = {view_path.name: view_path.stat().st_size}
    write_json_atomic(stats_path(root, SOURCE, "views", DATASET), asdict(record))


class AnonPeak:
    """The peak of this process's RssAnon + RssShmem, sampled every 10 ms in a thread."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_bytes())
            self._stop.wait(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())
        return self.peak


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[name] = int(value.split()[0]) * 1024
    return out


def anon_bytes() -> int:
    s = status()
    return s.get("RssAnon", 0) + s.get("RssShmem", 0)


def gb(n: float) -> float:
    return round(n / 1e9, 3)


def stage_mix(args) -> dict:
    peak = AnonPeak()
    from tasks.phases import mix

    root = Path(args.dir)
    cat = catalog(root, args.rows, args.resolution)
    planned = {}
    if args.buckets:
        from tasks.phases import plan

        start = time.perf_counter()
        report = plan.plan_phase(root, cat, cat.phase(PHASE), ranks_per_node=8)
        planned = {
            "plan_seconds": round(time.perf_counter() - start, 2),
            "plan_buckets": len(report["buckets"]),
            "plan_small_buckets": len(report["left_out"]["small_bucket"]["buckets"]),
        }
    start = time.perf_counter()
    report = mix.build_phase_set(root, cat, cat.phase(PHASE))
    seconds = time.perf_counter() - start
    phase_dir = root / "phases" / PHASE
    return {
        "mix_seconds": round(seconds, 2),
        "num_samples": report["num_samples"],
        "available": report["datasets"][0]["available"],
        "mix_peak_rss_anon_gb": gb(peak.stop()),
        "manifest_gb": gb((phase_dir / "manifest.parquet").stat().st_size),
        "row_index_gb": gb((phase_dir / "rows.npy").stat().st_size),
        "files": len(json.loads((phase_dir / "files.json").read_text())["files"]),
        **planned,
    }


def stage_rank(args) -> dict:
    peak = AnonPeak()
    started = time.time()
    import torch
    from torch.utils.data import DataLoader

    from sdtrain.data import EpochSampler, PhaseSet

    torch.set_num_threads(1)
    imported = time.time()
    data = PhaseSet(Path(args.dir) / "phases" / PHASE)
    opened = time.time()
    after_open = status()
    sampler = EpochSampler(len(data), seed=0, rank=args.rank, world_size=2)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    batches = iter(loader)
    for _ in range(args.batches):
        latents, ids, _ = next(batches)
        assert ids.dtype == torch.int64 and latents.dtype == torch.float32
    read = time.time()
    after_batches = status()
    return {
        "rank": args.rank,
        "opened_at": opened,
        "import_seconds": round(imported - started, 2),
        "open_seconds": round(opened - imported, 2),
        "batches_seconds": round(read - opened, 2),
        "rss_anon_after_open_gb": gb(after_open["RssAnon"] + after_open.get("RssShmem", 0)),
        "rss_anon_after_batches_gb": gb(
            after_batches["RssAnon"] + after_batches.get("RssShmem", 0)
        ),
        "rss_file_gb": gb(after_batches["RssFile"]),
        "rss_anon_peak_gb": gb(peak.stop()),
        "num_rows": len(data),
        "num_files": len(data.names),
    }


def child(stage: str, args, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    command = [
        sys.executable, __file__, "--stage", stage, "--dir", args.dir, "--rows", str(args.rows),
        "--shards", str(args.shards), "--resolution", str(args.resolution),
        "--batches", str(args.batches), "--buckets", str(args.buckets), *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"bench/mix.py: a child failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=None, help="default: rows / 10,000")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--buckets", type=int, default=0, help="aspect buckets (0: legacy)")
    parser.add_argument("--stage", choices=("mix", "rank"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.shards = args.shards or max(1, args.rows // 10_000)
    if args.stage:
        out = stage_mix(args) if args.stage == "mix" else stage_rank(args)
        print(json.dumps(out))
        return

    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="sdpipe-bench-mix-")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    need = args.rows * 80  # keys file, tokens and view parquets, manifest, row index
    free = shutil.disk_usage(root).free
    if free < 2 * need:
        raise SystemExit(f"bench/mix.py: {gb(free)} GB free under {root}, want {gb(2 * need)}")
    try:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        generate(root, args.rows, args.shards, args.resolution, args.buckets)
        generate_seconds = time.perf_counter() - start
        disk = sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())
        mixed = result(child("mix", args))
        if args.buckets:
            print(json.dumps({"bench": "mix", "buckets": args.buckets, "shards": args.shards,
                              "generate_seconds": round(generate_seconds, 1),
                              "machine": f"{platform.machine()} {os.cpu_count()} cores",
                              "load_avg_1m": [round(load_before, 2),
                                              round(os.getloadavg()[0], 2)],
                              **mixed}), flush=True)  # fmt: skip
            return
        spawned = time.time()
        ranks = [child("rank", args, ("--rank", str(r))) for r in (0, 1)]
        ranks = [result(r) for r in ranks]
        open_wall = max(r["opened_at"] for r in ranks) - spawned
        seconds = mixed["mix_seconds"] + open_wall
        rss = max(r["rss_anon_peak_gb"] for r in ranks)
        out = {
            "bench": "mix",
            "rows": mixed["num_samples"],
            "shards": args.shards,
            "encoded_rows": rows_per_shard(args.rows, args.shards) * args.shards,
            "view_rows": mixed["available"],
            "seconds": round(seconds, 2),
            "mix_seconds": mixed["mix_seconds"],
            "ranks_open_seconds": round(open_wall, 2),
            "rss_per_rank_gb": rss,
            "goal_seconds": GOALS["seconds"],
            "goal_rss_per_rank_gb": GOALS["rss_per_rank_gb"],
            "goals_met": {
                "seconds": seconds < GOALS["seconds"],
                "rss_per_rank_gb": rss < GOALS["rss_per_rank_gb"],
            },
            "mix": mixed,
            "ranks": [{k: v for k, v in r.items() if k != "opened_at"} for r in ranks],
            "generate_seconds": round(generate_seconds, 1),
            "disk_used_gb": gb(disk),
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        }
        print(json.dumps(out), flush=True)  # last: removing the inputs prints nothing
    finally:
        if made and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
