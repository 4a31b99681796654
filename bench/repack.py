"""Repack throughput: 1024 px JPEGs in a zip archive -> 512 px JPEG webdataset shard; prints JSON.

`images_per_s`: the production path (`tasks.sources.adapters.repack_shard`: one read of the archive,
decode by the rules of `tasks.latents.images` with libjpeg's DCT-domain reduction, resize down to a
short side of at most 512 px with the aspect kept, JPEG q95, in the crash-safe decode worker
pool, one worker per core). `pil_images_per_s`: a plain PIL loop doing the same job on these
square images (open, convert, resize short side with bicubic, center crop, JPEG q95 into a tar), one
process, as the recipe's scripts did. Both read the same archive in
the same run; `speedup_vs_pil` is their ratio, `speedup_vs_pil_per_core` the ratio with one
worker. Usage: python bench/repack.py [--images N] [--repeat R]
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
import tarfile
import tempfile
import time
import zipfile

import numpy as np
from PIL import Image

from bench.encode import cpu_name, photo_like
from catalog import FilterProfile, Source
from tasks.latents import images
from tasks.sources.adapters.base import Adapter, Entry, index_source, repack_shard

SIZE = 512


class ZipOfImages(Adapter):
    """Every image in `images.zip` under the location, captioned by its name."""

    def entries(self):
        with self.open("images.zip") as f, zipfile.ZipFile(f) as zf:
            for name in sorted(zf.namelist()):
                yield Entry(f"images.zip::{name}", name)


def make_archive(folder: Path, num_images: int, num_unique: int) -> Path:
    rng = np.random.default_rng(0)
    unique = []
    for _ in range(min(num_images, num_unique)):
        buf = io.BytesIO()
        Image.fromarray(photo_like(rng, 1024)).save(buf, format="JPEG", quality=90)
        unique.append(buf.getvalue())
    path = folder / "images.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for i in range(num_images):
            zf.writestr(f"{i:06d}.jpg", unique[i % len(unique)])
    return path


def pil_repack(archive: Path, out: Path) -> int:
    """The plain implementation: PIL, one image at a time, one process."""
    n = 0
    with zipfile.ZipFile(archive) as zf, tarfile.open(out, "w") as tar:
        for name in sorted(zf.namelist()):
            img = Image.open(io.BytesIO(zf.read(name))).convert("RGB")
            w, h = img.size
            scale = SIZE / min(w, h)
            img = img.resize(
                (max(SIZE, round(w * scale)), max(SIZE, round(h * scale))), Image.Resampling.BICUBIC
            )
            left, top = (img.width - SIZE) // 2, (img.height - SIZE) // 2
            img = img.crop((left, top, left + SIZE, top + SIZE))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=95)
            info = tarfile.TarInfo(f"{name.rsplit('.', 1)[0]}.jpg")
            info.size = buf.tell()
            buf.seek(0)
            tar.addfile(info, buf)
            n += 1
    return n


def sdpipe_repack(folder: Path, work: Path, num_workers: int) -> tuple[float, int]:
    source = Source(
        name="bench",
        kind="archive",
        location=str(folder),
        license="bench",
        profile="bench",
        resolution=SIZE,
        samples_per_shard=1_000_000,
    )
    adapter = ZipOfImages(source, FilterProfile(name="bench"))
    index_source(work, source, adapter)
    # Workers started (and their imports done) outside the timed region, as in a running stage.
    pool = images.DecodePool(num_workers, eager=True)
    try:
        for _ in range(4 * num_workers):
            pool.submit([], SIZE, "repack").result()
        start = time.perf_counter()
        stats = repack_shard(work, source, adapter, "00000", pool=pool)
        seconds = time.perf_counter() - start
    finally:
        pool.close()
    assert stats.dropped == {}, stats.dropped
    return seconds, stats.num_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--unique", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        archive = make_archive(tmp, args.images, args.unique)
        best: dict[str, float] = {}
        for r in range(args.repeat):  # interleaved, so both see the same machine
            for name, workers in (("sdpipe", cores), ("sdpipe_1", 1)):
                seconds, n = sdpipe_repack(tmp, tmp / f"{name}-{r}", workers)
                assert n == args.images
                best[name] = min(best.get(name, 1e9), seconds)
            start = time.perf_counter()
            assert pil_repack(archive, tmp / f"pil-{r}.tar") == args.images
            best["pil"] = min(best.get("pil", 1e9), time.perf_counter() - start)
    ips = {k: args.images / v for k, v in best.items()}
    print(
        json.dumps(
            {
                "bench": "repack",
                "images": args.images,
                "input_side": 1024,
                "output_side": SIZE,
                "workers": cores,
                "images_per_s": round(ips["sdpipe"], 1),
                "images_per_s_one_worker": round(ips["sdpipe_1"], 1),
                "pil_images_per_s": round(ips["pil"], 1),
                "speedup_vs_pil": round(ips["sdpipe"] / ips["pil"], 2),
                "speedup_vs_pil_per_core": round(ips["sdpipe_1"] / ips["pil"], 2),
                "cpu": cpu_name(),
                "cores": cores,
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
