"""A score task's peak memory does not grow with its shard: images stream through decode ->
preprocess -> networks a few batches at a time.

Each shard is scored in a fresh process that reports its own peak RSS (`ru_maxrss`, the whole
process: nothing subtracted). The networks are the tiny twins at the real networks' input
sizes (224 px for CLIP, 256 px for the watermark model), so an image's network inputs are
1.4 MB, as in production.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from tasks.sources import demo_source

PROJECT_ROOT = Path(__file__).resolve().parents[3]
NUM_IMAGES = 48  # the small shard; the large one has 4x. Either fills the pipeline's slots.
BATCH_SIZE = 8
INPUT_BYTES = 4 * 3 * (224 * 224 + 256 * 256)  # fp32 CLIP + watermark inputs of one image

# argv: data root, source, batch size. Prints the process's peak RSS (bytes) once the networks
# are built and the shard `warmup-<source>` is scored, and again after the measured shard.
SCORE = r"""
import dataclasses, json, resource, sys
from pathlib import Path
import torch
from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from tasks.curation import score

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def at_side(config, side):
    return {**config, "vision_cfg": {**config["vision_cfg"], "image_size": side, "patch_size": 32}}

tiny = load_catalog(PACKAGED_DIR).scorer("tiny-scoring")
spec = dataclasses.replace(
    tiny,
    name="tiny-at-224",
    embed_config=at_side(tiny.embed_config, 224),
    similarity_config=at_side(tiny.similarity_config, 224),
    watermark_side=256,
)
root, source, batch_size = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
kw = dict(device="cpu", batch_size=batch_size, workers=2)
score.score_shard(root, f"warmup-{source}", "00000", spec, **kw)
built = peak()
stats = score.score_shard(root, source, "00000", spec, **kw)
print(json.dumps({"built": built, "peak": peak(), "num_out": stats.num_out}))
"""


def grainy_jpegs(count: int) -> list[bytes]:
    """512 px scenes with film grain: ~70 KB JPEGs, as a 512 px photo fetched for SD1.5."""
    jpegs = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        img, _ = demo_source.draw_scene(rng, 512, 512)
        grain = rng.normal(0, 8, (512, 512, 3))
        pixels = np.clip(np.asarray(img, np.float64) + grain, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        jpegs.append(buf.getvalue())
    return jpegs


def write_shard(root: Path, source: str, num_images: int, jpegs: list[bytes]) -> None:
    shards = root / source / "shards"
    shards.mkdir(parents=True)
    rows = []
    with tarfile.open(shards / "00000.tar", "w") as tar:
        for i in range(num_images):
            key = f"{i:06d}"
            for name, data in ((f"{key}.jpg", jpegs[i % len(jpegs)]), (f"{key}.txt", b"a scene")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            rows.append({"key": key, "caption": "a scene", "status": "success"})
    pq.write_table(pa.Table.from_pylist(rows), shards / "00000.parquet")


def score_in_fresh_process(root: Path, source: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCORE, str(root), source, str(BATCH_SIZE)],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_score_peak_memory_does_not_grow_with_the_shard(tmp_path):
    jpegs = grainy_jpegs(16)
    for source, num_images in (("small", NUM_IMAGES), ("large", 4 * NUM_IMAGES)):
        write_shard(tmp_path, source, num_images, jpegs)
        write_shard(tmp_path, f"warmup-{source}", BATCH_SIZE, jpegs)

    small = score_in_fresh_process(tmp_path, "small")
    large = score_in_fresh_process(tmp_path, "large")
    assert (small["num_out"], large["num_out"]) == (NUM_IMAGES, 4 * NUM_IMAGES)
    mib = {k: f"{v['peak'] / 2**20:.0f} MiB" for k, v in {"small": small, "large": large}.items()}
    # The measure: the whole process's peak, 4x the images, within 10%.
    assert large["peak"] <= 1.10 * small["peak"], mib
    # Sharper: what scoring added over the built networks grows by far less than holding the
    # extra images' network inputs would take (the old decode-everything-first: 1.7 MB each).
    growth = (large["peak"] - large["built"]) - (small["peak"] - small["built"])
    assert growth < 0.5 * 3 * NUM_IMAGES * INPUT_BYTES, (mib, growth / 2**20)
