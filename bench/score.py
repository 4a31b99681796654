"""Score-stage throughput: images/s of `tasks.curation.score.score_shard` over one shard of JPEGs.

--size tiny: the catalog's tiny twins; --size full: the real architectures (ViT-L/14 +
ViT-B/32 + EfficientNet-B3, 256x256 watermark input) with random weights, so nothing is
downloaded. Model building and a warm-up shard are timed apart from the measured shard; the
figure includes decoding and preprocessing (worker threads), as the stage runs them.

Both paths run in the same process on the same shard: the baseline (`fast=False`: float32
tensors made per image, fp16 autocast over fp32 weights, up to 8 workers) first, then the
fast path (uint8 pixels normalized on the device, fp16 weights on CUDA, every core):
`baseline_images_per_s`, `images_per_s`, `speedup`. `cpu_images_per_s` is the fast path's CPU
side alone (decode, PIL resizes, pHash into slots, same workers, no networks): the ceiling the
CPU puts on it; `cpu_ms_per_image` its per-image CPU time in one thread. `--no-baseline` skips
the old path. The fast path decodes where the stage would (processes on CUDA, threads
elsewhere; `--decode` to choose), and `cpu_images_per_s_threads` / `_processes` time the CPU side
both ways side by side (decode threads meet at the GIL; processes write shared slots).
`--cpu-side-only` builds the scorer and times only that CPU side (no shard scored, no networks
run): the figure on a machine too small to run the networks. `peak_rss_gb` is the process's
peak resident memory (networks, warm-up and shards): with a shard streamed a few batches at a
time, it does not grow with --images.
Usage: python bench/score.py [--device cpu|cuda] [--size tiny|full] [--images N] [--side S]
    [--batch-size B] [--workers W] [--no-baseline] [--grain] [--decode threads|processes]
    [--cpu-side-only]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import io
import json
import os
import platform
import resource
import shutil
import tarfile
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DISTINCT = 512  # different images in a shard, cycled beyond


def write_shard(
    root: Path, shard: str, num_images: int, side: int, seed: int, grain: bool = False
) -> None:
    """A fetched shard as fetch-images leaves it: NNNNN.tar of JPEGs + its sample table.

    At most DISTINCT different images, cycled (drawing and encoding 2,048 took longer than
    scoring them). grain: film grain on each scene (one of four noise fields), ~70 KB at
    512 px like a photo; else ~8 KB with flat areas."""
    from PIL import Image

    from tasks.sources import demo_source

    rng = np.random.default_rng(seed)
    out = root / "bench" / "shards"
    out.mkdir(parents=True, exist_ok=True)
    noise = [rng.normal(0, 8, (side, side, 3)).round().astype(np.int16) for _ in range(4 * grain)]
    drawn = []
    for i in range(min(num_images, DISTINCT)):
        img, caption = demo_source.draw_scene(rng, side, side)
        if grain:
            pixels = np.asarray(img, np.int16) + noise[i % len(noise)]
            img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        drawn.append((buf.getvalue(), caption))
    rows = []
    with tarfile.open(out / f"{shard}.tar", "w") as tar:
        for i in range(num_images):
            data, caption = drawn[i % len(drawn)]
            key = f"{shard}{i:07d}"
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            rows.append({"key": key, "caption": caption, "status": "success"})
    pq.write_table(pa.Table.from_pylist(rows), out / f"{shard}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--images", type=int, default=None, help="default 512 tiny, 256 full")
    parser.add_argument("--side", type=int, default=512, help="shard image side (512: sd15)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None, help="default: the stage's own")
    parser.add_argument("--no-baseline", action="store_true", help="time the fast path only")
    parser.add_argument("--grain", action="store_true", help="photo-like ~70 KB JPEGs")
    parser.add_argument("--decode", choices=["threads", "processes"], default=None)
    parser.add_argument("--cpu-side-only", action="store_true", help="no networks run")
    args = parser.parse_args()
    import torch

    from catalog import load_catalog
    from catalog.schema import ScoringModel
    from tasks.curation import score
    from tasks.runtime import concurrency
    from tasks.runtime.node import local_node

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.size == "tiny":
        spec = load_catalog().scorer("tiny-scoring")
    else:  # the architectures of laion-scoring, random weights
        spec = ScoringModel(name="full-random", kind="scoring", random_weights=True)
    num_images = args.images or (512 if args.size == "tiny" else 256)
    batch_size = args.batch_size or spec.batch_size
    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-score-"))
    runs = {}
    try:
        write_shard(work, "00000", batch_size, args.side, seed=0, grain=args.grain)  # warm-up
        write_shard(work, "00001", num_images, args.side, seed=1, grain=args.grain)
        processes = None if args.decode is None else args.decode == "processes"
        paths = () if args.cpu_side_only else (False, True) if not args.no_baseline else (True,)
        for fast in paths:
            # Each path its own data root over the same shards (a done shard is skipped).
            root = work / ("fast" if fast else "baseline")
            (root / "bench").mkdir(parents=True)
            (root / "bench" / "shards").symlink_to(work / "bench" / "shards")
            start = time.perf_counter()
            scorer = score.load_scorer(spec, torch.device(device), fast=fast)
            build_s = time.perf_counter() - start
            kw = dict(device=device, batch_size=batch_size, workers=args.workers, fast=fast)
            kw["node"] = local_node(args.workers)  # its decode processes: the budget's
            if fast:
                kw["processes"] = processes
            score.score_shard(root, "bench", "00000", spec, **kw)
            stats = score.score_shard(root, "bench", "00001", spec, **kw)
            runs[fast] = (scorer, stats, build_s)
        if not runs:
            start = time.perf_counter()
            scorer = score.load_scorer(spec, torch.device(device), fast=True)
            runs[True] = (scorer, None, time.perf_counter() - start)
        images = read_shard(work, "00001")
        jpeg_bytes = sum(len(d) for d in images)
        workers = args.workers or default_workers(device)
        # The stage's process pool: the node's worker budget (SDPIPE_WORKERS, else the cores).
        process_workers = args.workers or concurrency.workers()
        in_processes = device == "cuda" if processes is None else processes
        cpu_rates = {
            "threads": cpu_side_rate(runs[True][0], images, batch_size, workers, False),
            "processes": cpu_side_rate(runs[True][0], images, batch_size, process_workers, True),
        }
        cpu_ms = cpu_ms_per_image(runs[True][0], images[:64])
    finally:
        shutil.rmtree(work)
    scorer, stats, build_s = runs[True]
    rate = stats.num_out / stats.seconds if stats else None
    base = runs.get(False)
    base_rate = base[1].num_out / base[1].seconds if base else None
    nets = (scorer.embed, scorer.similarity, scorer.aesthetic, scorer.nsfw, scorer.watermark)
    print(
        json.dumps(
            {
                "bench": "score",
                "size": args.size,
                "device": device,
                "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                "torch": torch.__version__,
                "images": stats.num_out if stats else len(images),
                "image_side": args.side,
                "jpeg_kb": round(jpeg_bytes / len(images) / 1e3, 1),
                "batch_size": batch_size,
                "workers": process_workers if in_processes else workers,
                "decode": "processes" if in_processes else "threads",
                "thread_workers": workers,
                "process_workers": process_workers,
                "baseline_workers": args.workers or min(8, os.cpu_count() or 1),
                "seconds": stats.seconds if stats else None,
                "images_per_s": round(rate, 1) if stats else None,
                "baseline_seconds": base[1].seconds if base else None,
                "baseline_images_per_s": round(base_rate, 1) if base else None,
                "speedup": round(rate / base_rate, 2) if base else None,
                "precision": "fp16 weights" if scorer.half else "fp32",
                "baseline_precision": "fp16 autocast" if device == "cuda" else "fp32",
                "cpu_images_per_s": round(cpu_rates["processes" if in_processes else "threads"], 1),
                "cpu_images_per_s_threads": round(cpu_rates["threads"], 1),
                "cpu_images_per_s_processes": round(cpu_rates["processes"], 1),
                "cpu_processes_vs_threads": round(cpu_rates["processes"] / cpu_rates["threads"], 2),
                "cpu_ms_per_image": cpu_ms,
                "build_seconds": round(build_s, 2),
                "params_m": round(sum(p.numel() for n in nets for p in n.parameters()) / 1e6, 1),
                "torch_threads": torch.get_num_threads(),
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


def default_workers(device: str) -> int:
    """The stage's default for the fast path (tasks.score.score_shard)."""
    cores = os.cpu_count() or 1
    return cores if device == "cuda" else min(8, cores)


def read_shard(root: Path, shard: str) -> list[bytes]:
    with tarfile.open(root / "bench" / "shards" / f"{shard}.tar") as tar:
        return [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]


def cpu_side_rate(scorer, images: list[bytes], batch_size: int, workers: int, processes: bool):
    """images/s of the fast path's CPU side alone: each image decoded, resized and pHashed
    into a slot by the stage's own decoders (threads, or the node's decode processes), slots
    freed in order as score_images frees them, no networks. A first pass over a few chunks
    per worker starts the processes' imports and is not timed."""
    from collections import deque

    from tasks.curation import score_decode, score_slots
    from tasks.runtime.node import local_node

    pool = score_decode.decode_pool(local_node(workers)) if processes else None

    def run(data: list[bytes]) -> float:
        slots = score_slots.Slots(scorer, 3 * batch_size, shared=processes)
        decoders = score_slots.Decoders(scorer, slots, workers, pool, score_decode.CHUNK)
        pending: deque[tuple[int, int]] = deque()
        start = time.perf_counter()
        try:
            for i, image in enumerate(data):
                while not slots.free:
                    j, slot = pending.popleft()
                    decoders.result(j)
                    slots.free.append(slot)
                slot = slots.free.pop()
                decoders.decode(i, slot, image)
                pending.append((i, slot))
            decoders.flush()
            while pending:
                decoders.result(pending.popleft()[0])
        finally:
            decoders.close()
            slots.close()
        return len(data) / (time.perf_counter() - start)

    run(images[: 2 * workers * score_decode.CHUNK])
    return run(images)


def cpu_ms_per_image(scorer, images: list[bytes]) -> dict:
    """Per-image CPU ms of each step of the fast path's CPU side, in this thread."""
    from PIL import Image

    from tasks.curation import score

    steps = {"decode": 0.0, "resize_crop": 0.0, "phash": 0.0}
    for data in images:
        t0 = time.perf_counter()
        img = Image.open(io.BytesIO(data)).convert("RGB")
        t1 = time.perf_counter()
        scorer.prepare(img)
        t2 = time.perf_counter()
        score.phash(img)
        t3 = time.perf_counter()
        steps["decode"] += t1 - t0
        steps["resize_crop"] += t2 - t1
        steps["phash"] += t3 - t2
    out = {k: round(v / len(images) * 1e3, 3) for k, v in steps.items()}
    out["total"] = round(sum(out.values()), 3)
    return out


if __name__ == "__main__":
    main()
