"""encode: latents equal a plain one-image-at-a-time VAE reference; bad images are dropped.

Also here: fetch-metadata's column check, the other place a shard's input can be unusable.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from sdtrain.models import build_vae
from tasks import encode, metadata
from tasks.metadata import SourceError
from tasks.shards import TMP_MARK

SOURCE = "src"
SHARD = "00000"


@pytest.fixture(scope="module")
def tiny():
    return load_catalog(PACKAGED_DIR).model("tiny")


@pytest.fixture(scope="module")
def reference_vae(tiny):
    """The tiny VAE built afresh: the stage's own copy must have the same weights."""
    return build_vae(tiny).eval().requires_grad_(False)


def image_bytes(rng: np.random.Generator, width: int, height: int, mode: str, fmt: str) -> bytes:
    """A smooth random texture, so a shifted crop or swapped channels changes the latents."""
    noise = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels = cv2.GaussianBlur(noise, (0, 0), 1.5)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def reference_pixels(data: bytes, size: int) -> np.ndarray:
    """PIL decode to RGB, short side resized to `size` (cv2, as the stage does), center crop."""
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    h, w = rgb.shape[:2]
    scale = size / min(h, w)
    new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
    if (new_w, new_h) != (w, h):
        interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC
        rgb = cv2.resize(rgb, (new_w, new_h), interpolation=interpolation)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return rgb[top : top + size, left : left + size]


@torch.no_grad()
def reference_latent(vae, data: bytes, size: int) -> np.ndarray:
    """fp32 posterior mean x 0.18215 of one image, in [4, size/8, size/8]."""
    pixels = torch.from_numpy(reference_pixels(data, size).copy()).float()
    x = (pixels / 127.5 - 1.0).permute(2, 0, 1)[None]
    return (vae.encode(x).latent_dist.mean * 0.18215)[0].numpy()


# (width, height, PIL mode, format): landscape and portrait downscales, upscales of images
# smaller than the model side, an exact fit, grayscale and RGBA (alpha dropped, not blended).
IMAGES = {
    "wide": (200, 120, "RGB", "JPEG"),
    "tall": (97, 131, "RGB", "JPEG"),
    "small": (50, 90, "RGB", "PNG"),
    "exact": (64, 64, "RGB", "PNG"),
    "gray": (80, 70, "L", "PNG"),
    "alpha": (100, 300, "RGBA", "PNG"),
    "panorama": (640, 70, "RGB", "JPEG"),
}


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {key: image_bytes(rng, *spec) for key, spec in IMAGES.items()}


@pytest.fixture(scope="module")
def reference_latents(images, tiny, reference_vae) -> dict[str, np.ndarray]:
    return {
        key: reference_latent(reference_vae, data, tiny.resolution) for key, data in images.items()
    }


def assert_close_to_reference(latent: np.ndarray, reference: np.ndarray, key: str = "") -> None:
    # fp16 storage: equal within 1% of the latents' spread.
    np.testing.assert_allclose(
        latent.astype(np.float32),
        reference,
        rtol=0,
        atol=1e-2 * float(reference.std()),
        err_msg=key,
    )


@pytest.mark.parametrize("key", list(IMAGES))
def test_load_image_is_rgb_short_side_resize_and_center_crop(images, tiny, key):
    pixels = encode.load_image(images[key], tiny.resolution)
    assert pixels.dtype == np.uint8
    assert pixels.shape == (tiny.resolution, tiny.resolution, 3)
    np.testing.assert_array_equal(pixels, reference_pixels(images[key], tiny.resolution))


def test_load_image_returns_none_for_bytes_that_are_not_an_image(tiny):
    assert encode.load_image(b"<html>not found</html>", tiny.resolution) is None


def test_encode_images_equals_one_at_a_time_fp32_reference(images, tiny, reference_latents):
    vae = build_vae(tiny).eval()
    batch = np.stack([encode.load_image(data, tiny.resolution) for data in images.values()])
    latents = encode.encode_images(vae, batch, tiny.scaling_factor)
    side = tiny.resolution // 8
    assert latents.dtype == np.float16
    assert latents.shape == (len(images), 4, side, side)
    for latent, key in zip(latents, images, strict=True):
        assert_close_to_reference(latent, reference_latents[key], key)


def write_shard(root: Path, members: dict[str, bytes], token_keys: list[str]) -> None:
    """A fetched shard tar (key.jpg/png, key.txt, key.json) and its token table."""
    shards = root / SOURCE / "shards"
    shards.mkdir(parents=True)
    with tarfile.open(shards / f"{SHARD}.tar", "w") as tar:
        for key, data in members.items():
            ext = "png" if data.startswith(b"\x89PNG") else "jpg"
            for name, payload in (
                (f"{key}.{ext}", data),
                (f"{key}.txt", b"a caption"),
                (f"{key}.json", json.dumps({"key": key}).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    (root / SOURCE / "tokens").mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "key": token_keys,
                "input_ids": pa.array([[0] * 77] * len(token_keys), pa.list_(pa.int32(), 77)),
            }
        ),
        root / SOURCE / "tokens" / f"{SHARD}.parquet",
    )


def test_encode_shard_rows_follow_keys_and_bad_images_are_dropped(
    tmp_path, images, tiny, reference_latents
):
    members = dict(images)
    members["broken"] = b"<html>this is an error page, not a JPEG</html>\n" * 20
    members["truncated"] = images["wide"][:200]
    # Token order differs from the tar's, and one token key has no image in the tar.
    token_keys = [
        "tall",
        "broken",
        "wide",
        "gone",
        "small",
        "truncated",
        "exact",
        "gray",
        "alpha",
        "panorama",
    ]
    write_shard(tmp_path, members, token_keys)

    stats = encode.encode_shard(tmp_path, SOURCE, SHARD, tiny, batch_size=3)

    assert stats.dropped == {"decode_error": 2, "missing_image": 1}
    assert (stats.num_in, stats.num_out) == (10, 7)
    kept = [k for k in token_keys if k in images]
    assert stats.extra["keys"] == kept
    assert stats.extra["token_rows"] == [token_keys.index(k) for k in kept]
    latents = np.load(tmp_path / SOURCE / "latents" / f"{SHARD}.npy")
    assert latents.dtype == np.float16
    assert latents.shape == (7, 4, tiny.resolution // 8, tiny.resolution // 8)
    for row, key in enumerate(kept):
        assert_close_to_reference(latents[row], reference_latents[key], key)
    assert not [p for p in tmp_path.rglob("*") if TMP_MARK in p.name]


def test_encode_shard_where_no_image_decodes_writes_zero_rows(tmp_path, tiny):
    write_shard(tmp_path, {"broken": b"not an image"}, ["broken"])
    stats = encode.encode_shard(tmp_path, SOURCE, SHARD, tiny)
    latents = np.load(tmp_path / SOURCE / "latents" / f"{SHARD}.npy")
    assert stats.dropped == {"decode_error": 1}
    assert stats.extra["keys"] == []
    assert latents.shape == (0, 4, tiny.resolution // 8, tiny.resolution // 8)


# ---- fetch-metadata: a file without the columns a stage needs ------------------------------


def test_normalize_names_missing_and_found_columns():
    table = pa.table({"link": ["http://x/a.jpg"], "TEXT": ["a cat"], "WIDTH": [10]})
    with pytest.raises(SourceError) as info:
        metadata.normalize(table, SOURCE, SHARD, "part-00000.parquet")
    message = str(info.value)
    assert "part-00000.parquet" in message
    assert "['url']" in message  # what is missing
    assert "'URL'" in message  # the spellings that would have been accepted
    assert "'link'" in message and "'TEXT'" in message  # what was found


def test_normalize_renames_upstream_columns_and_assigns_stable_keys():
    table = pa.table(
        {
            "URL": ["http://x/a.jpg", "http://x/b.jpg"],
            "TEXT": ["a", "b"],
            "WIDTH": [10, 20],
            "AESTHETIC_SCORE": [5.0, 6.0],
            "extra": [1, 2],
        }
    )
    out = metadata.normalize(table, SOURCE, "00003", "part.parquet")
    assert out.column_names == ["key", "source", "url", "caption", "width", "aesthetic"]
    assert out["key"].to_pylist() == ["000030000000", "000030000001"]
    assert out["width"].type == pa.float64()


def test_fetch_metadata_shard_without_url_column_fails_and_marks_nothing_done(tmp_path, tiny):
    upstream = tmp_path / "upstream.parquet"
    pq.write_table(pa.table({"caption": ["a cat"]}), upstream)
    source = load_catalog(PACKAGED_DIR).source("laion")
    with pytest.raises(SourceError):
        metadata.fetch_metadata_shard(tmp_path, source, 0, str(upstream))
    stage_dir = tmp_path / source.name / "metadata"
    assert not stage_dir.exists() or list(stage_dir.iterdir()) == []
