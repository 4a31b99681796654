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
the old path. `peak_rss_gb` is the process's peak resident memory (networks, warm-up and
shards): with a shard streamed a few batches at a time, it does not grow with --images.
Usage: python bench/score.py [--device cpu|cuda] [--size tiny|full] [--images N] [--side S]
    [--batch-size B] [--workers W] [--no-baseline] [--grain]
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
    args = parser.parse_args()
    import torch

    from catalog import load_catalog
    from catalog.schema import ScoringModel
    from tasks.curation import score

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
        for fast in (False, True) if not args.no_baseline else (True,):
            # Each path its own data root over the same shards (a done shard is skipped).
            root = work / ("fast" if fast else "baseline")
            (root / "bench").mkdir(parents=True)
            (root / "bench" / "shards").symlink_to(work / "bench" / "shards")
            start = time.perf_counter()
            scorer = score.load_scorer(spec, torch.device(device), fast=fast)
            build_s = time.perf_counter() - start
            kw = dict(device=device, batch_size=batch_size, workers=args.workers, fast=fast)
            score.score_shard(root, "bench", "00000", spec, **kw)
            stats = score.score_shard(root, "bench", "00001", spec, **kw)
            runs[fast] = (scorer, stats, build_s)
        images = read_shard(work, "00001")
        jpeg_bytes = sum(len(d) for d in images)
        workers = args.workers or default_workers(device)
        cpu_rate = cpu_side_rate(runs[True][0], images, batch_size, workers)
        cpu_ms = cpu_ms_per_image(runs[True][0], images[:64])
    finally:
        shutil.rmtree(work)
    scorer, stats, build_s = runs[True]
    rate = stats.num_out / stats.seconds
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
                "images": stats.num_out,
                "image_side": args.side,
                "jpeg_kb": round(jpeg_bytes / len(images) / 1e3, 1),
                "batch_size": batch_size,
                "workers": workers,
                "baseline_workers": args.workers or min(8, os.cpu_count() or 1),
                "seconds": stats.seconds,
                "images_per_s": round(rate, 1),
                "baseline_seconds": base[1].seconds if base else None,
                "baseline_images_per_s": round(base_rate, 1) if base else None,
                "speedup": round(rate / base_rate, 2) if base else None,
                "precision": "fp16 weights" if scorer.half else "fp32",
                "baseline_precision": "fp16 autocast" if device == "cuda" else "fp32",
                "cpu_images_per_s": round(cpu_rate, 1),
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


def cpu_side_rate(scorer, images: list[bytes], batch_size: int, workers: int) -> float:
    """images/s of the fast path's CPU side alone: each image decoded, resized and pHashed
    into a slot by the same worker threads, no networks."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.curation import score

    slots = score._Slots(scorer, 3 * batch_size)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(score._decode, scorer, data, slots, i % len(slots.free))
            for i, data in enumerate(images)
        ]
        for f in futures:
            f.result()
    return len(images) / (time.perf_counter() - start)


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
