"""Score-stage throughput: images/s of `tasks.curation.score.score_shard` over one shard of JPEGs.

--size tiny: the catalog's tiny twins; --size full: the real architectures (ViT-L/14 +
ViT-B/32 + EfficientNet-B3, 256x256 watermark input) with random weights, so nothing is
downloaded. Model building and a warm-up shard are timed apart from the measured shard; the
figure includes decoding and preprocessing (worker threads), as the stage runs them.
`peak_rss_gb` is the process's peak resident memory (networks, warm-up and shard): with the
shard streamed a few batches at a time, it does not grow with --images.
Usage: python bench/score.py [--device cpu|cuda] [--size tiny|full] [--images N] [--side S]
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


def write_shard(root: Path, shard: str, num_images: int, side: int, seed: int) -> None:
    """A fetched shard as fetch-images leaves it: NNNNN.tar of JPEGs + its sample table."""
    from tasks.sources import demo_source

    rng = np.random.default_rng(seed)
    out = root / "bench" / "shards"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tarfile.open(out / f"{shard}.tar", "w") as tar:
        for i in range(num_images):
            img, caption = demo_source.draw_scene(rng, side, side)
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            key = f"{shard}{i:07d}"
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = buf.tell()
            buf.seek(0)
            tar.addfile(info, buf)
            rows.append({"key": key, "caption": caption, "status": "success"})
    pq.write_table(pa.Table.from_pylist(rows), out / f"{shard}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--images", type=int, default=None, help="default 512 tiny, 256 full")
    parser.add_argument("--side", type=int, default=512, help="shard image side (512: sd15)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None)
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
    try:
        write_shard(work, "00000", batch_size, args.side, seed=0)  # warm-up
        write_shard(work, "00001", num_images, args.side, seed=1)
        start = time.perf_counter()
        scorer = score.load_scorer(spec, torch.device(device))
        build_s = time.perf_counter() - start
        kw = dict(device=device, batch_size=batch_size, workers=args.workers)
        score.score_shard(work, "bench", "00000", spec, **kw)
        stats = score.score_shard(work, "bench", "00001", spec, **kw)
    finally:
        shutil.rmtree(work)
    nets = (scorer.embed, scorer.similarity, scorer.aesthetic, scorer.nsfw, scorer.watermark)
    print(
        json.dumps(
            {
                "bench": "score",
                "size": args.size,
                "device": device,
                "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                "images": stats.num_out,
                "image_side": args.side,
                "batch_size": batch_size,
                "seconds": stats.seconds,
                "images_per_s": round(stats.num_out / stats.seconds, 1),
                "build_seconds": round(build_s, 2),
                "params_m": round(sum(p.numel() for n in nets for p in n.parameters()) / 1e6, 1),
                "torch_threads": torch.get_num_threads(),
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
