"""encode holds a few batches' image bytes, not a shard's: a shard streams from its tar through
the decoders (issue 26, item 6), in either latent layout.

The measure is tracemalloc's peak over one shard's encode, after a warm-up shard built the VAE
and the decode pool: every Python object and numpy array the pipeline holds (image bytes, the
decoders' pixels, the latents), not torch's ring buffers or the VAE's activations, which are a
batch's by construction. The window is narrowed (DECODE_AHEAD) so the shard is many windows.
"""

from __future__ import annotations

import dataclasses
import io
import tarfile
import tracemalloc
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from tasks.latents import encode, encode_pipeline, latent_keys
from tasks.runtime.shards import failure_path

SOURCE = "src"
BATCH_SIZE = 4
DECODE_AHEAD = 8  # images; the pipeline's default is 128
NUM_IMAGES = 256  # ~0.5 MB each: a shard of ~115 MB


def large_jpeg(seed: int, side: int = 720) -> bytes:
    """A grainy `side` px JPEG at q95 (~0.5 MB): bytes a 512 px decode must read through."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    pixels = cv2.GaussianBlur(noise, (0, 0), 0.6)
    return cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()


def write_shard(root: Path, shard: str, members: dict[str, bytes], token_keys: list[str]) -> Path:
    shards, tokens = root / SOURCE / "shards", root / SOURCE / "tokens"
    shards.mkdir(parents=True, exist_ok=True)
    tokens.mkdir(parents=True, exist_ok=True)
    with tarfile.open(shards / f"{shard}.tar", "w") as tar:
        for key, data in members.items():
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ids = pa.array([[0] * 77] * len(token_keys), pa.list_(pa.int32(), 77))
    pq.write_table(pa.table({"key": token_keys, "input_ids": ids}), tokens / f"{shard}.parquet")
    return shards / f"{shard}.tar"


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return [large_jpeg(seed) for seed in range(4)]


@pytest.fixture(params=["legacy", "buckets"])
def model(request):
    tiny = load_catalog(PACKAGED_DIR).model("tiny")
    return dataclasses.replace(tiny, buckets=None) if request.param == "legacy" else tiny


def test_encode_holds_a_few_batches_of_image_bytes_not_a_shard(tmp_path, jpegs, model, monkeypatch):
    monkeypatch.setattr(encode_pipeline, "DECODE_AHEAD", DECODE_AHEAD)
    for shard, n in (("00000", BATCH_SIZE), ("00001", NUM_IMAGES)):
        members = {f"{shard}-{i:04d}": jpegs[i % len(jpegs)] for i in range(n)}
        tar = write_shard(tmp_path, shard, members, list(members))
    shard_bytes = tar.stat().st_size
    encode.encode_shard(tmp_path, SOURCE, "00000", model, batch_size=BATCH_SIZE)

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stats = encode.encode_shard(tmp_path, SOURCE, "00001", model, batch_size=BATCH_SIZE)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()

    assert stats.num_out == NUM_IMAGES
    # Whole-tar reading held the tar and its images (2x the shard); streamed, the window's
    # images (DECODE_AHEAD, the read-ahead, the batches at the VAE): ~35 of the shard's 256.
    assert peak < shard_bytes / 4, f"{peak / 2**20:.1f} of {shard_bytes / 2**20:.1f} MiB held"


def test_a_tar_cut_short_inside_an_image_fails_its_shard_alone(tmp_path, jpegs):
    model = dataclasses.replace(load_catalog(PACKAGED_DIR).model("tiny"), buckets=None)
    for shard in ("00000", "00001"):
        members = {f"{shard}-{i}": jpegs[i] for i in range(3)}
        write_shard(tmp_path, shard, members, list(members))
    with open(tmp_path / SOURCE / "shards" / "00000.tar", "r+b") as f:
        f.truncate(len(jpegs[0]) * 2)  # the second image's bytes are cut short
    stream = encode.encode_stream(tmp_path, SOURCE, ["00000", "00001"], model, batch_size=2)
    (first, error), (second, stats) = list(stream)

    assert first == "00000" and isinstance(error, tarfile.ReadError)
    assert failure_path(tmp_path, SOURCE, "latents", "00000").is_file()
    assert not latent_keys.path(tmp_path, SOURCE, "00000").exists()
    assert (second, stats.num_out) == ("00001", 3)
