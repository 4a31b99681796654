"""The shards' transform (`images.repack_image`): each image resized down to at most size²
pixels with its aspect ratio kept, never up; a reduced JPEG decode that lands on the same
stored size as the full one; the crop box of a source (COCO) cut before the resize; every drop
rule as before. Readers (`decode_image`) still get `size` x `size` squares of what is stored."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from catalog import buckets
from tasks.latents import images
from tests.tasks import bad_images as bad


def smooth(width: int, height: int, seed: int = 0) -> np.ndarray:
    """RGB uint8 [height, width, 3]: low-frequency colour waves (resizes and reduced decodes of
    it differ by little, so pixels can be compared), the top-left quarter red-marked."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5), rng.uniform(0, 6)
        wave = np.sin(2 * np.pi * (fx * x / width + fy * y / height) + phase)
        channels.append(128 + 90 * wave)
    rgb = np.stack(channels, -1).astype(np.uint8)
    rgb[: height // 4, : width // 4] = bad.RED
    return rgb


def jpeg(rgb: np.ndarray, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def decoded(data: bytes) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert bgr is not None
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def full_reference(data: bytes, size: int, crop=None) -> np.ndarray:
    """The transform without a reduced decode: full decode, crop, INTER_AREA to the stored
    size of the kept region, JPEG quality 95 (at a few dozen pixels the JPEG's own error
    outweighs the reduced decode's), decoded."""
    rgb = decoded(data)
    if crop:
        x, y, w, h = crop
        rgb = rgb[y : y + h, x : x + w]
    h, w = rgb.shape[:2]
    target = buckets.stored_size(w, h, size)
    if target != (w, h):
        rgb = cv2.resize(rgb, target, interpolation=cv2.INTER_AREA)
    bgr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
    return decoded(cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes())


def mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int32) - b.astype(np.int32)).mean())


def test_a_wide_photo_is_stored_with_its_short_side_at_size_and_its_aspect():
    data = jpeg(smooth(1920, 1080))
    stored, width, height = images.repack_image(data, 512)
    assert (width, height) == (1920, 1080)  # the original size, as the sample tables record it
    rgb = decoded(stored)
    h, w = rgb.shape[:2]
    assert (w, h) == buckets.stored_size(1920, 1080, 512) == (910, 512)
    assert abs((w / h) / (1920 / 1080) - 1) < 0.01
    assert mean_abs(rgb, full_reference(data, 512)) < 2.0
    # The red quarter stays the top-left quarter: not cropped, not turned.
    assert np.abs(rgb[: h // 4 - 4, : w // 4 - 4].astype(int) - bad.RED).max() <= 20


def test_a_portrait_keeps_its_aspect_too():
    data = jpeg(smooth(600, 900))
    stored, width, height = images.repack_image(data, 256)
    h, w = decoded(stored).shape[:2]
    assert (width, height) == (600, 900)
    assert (w, h) == buckets.stored_size(600, 900, 256) and h > w
    assert w == 256 and abs((w / h) / (600 / 900) - 1) < 0.01


def test_a_small_image_is_stored_at_its_own_size_not_upscaled():
    rgb = smooth(300, 200)
    for data in (jpeg(rgb), bad.encode(rgb, "PNG")):
        stored, width, height = images.repack_image(data, 512)
        assert (width, height) == (300, 200)
        out = decoded(stored)
        assert out.shape == (200, 300, 3)
        assert mean_abs(out, rgb) < 2.0


def test_an_image_with_a_short_side_under_size_is_kept_at_its_size():
    stored, _, _ = images.repack_image(jpeg(smooth(128, 32)), 64)
    assert decoded(stored).shape == (32, 128, 3)  # short side 32 < 64: not resized


@pytest.mark.parametrize(
    ("width", "height", "size", "reduce"),
    [
        (2400, 1350, 512, 2),
        (1920, 1080, 64, 8),
        (3000, 500, 128, 4),  # the long side cap (512 x 85) leaves room for 4, not 8
        (1500, 1000, 256, 2),
        (2048, 2048, 512, 4),
    ],
)
def test_a_reduced_jpeg_decode_lands_on_the_full_decodes_stored_size(width, height, size, reduce):
    data = jpeg(smooth(width, height, seed=width))
    target = buckets.stored_size(width, height, size)
    assert images.stored_reduction((width, height), target) == reduce
    # The reduced image holds at least the stored sides (libjpeg rounds its sides up).
    reduced = images.decode_rgb(data, size, reduce=reduce)
    assert reduced.shape[1] >= target[0] and reduced.shape[0] >= target[1]
    full = cv2.resize(decoded(data), target, interpolation=cv2.INTER_AREA)
    # Before the JPEG. A side that is no multiple of the reduction ends in a partial DCT block,
    # a whole reduced pixel: that edge lands up to a stored pixel off (as PIL's `draft`).
    aligned = width % reduce == 0 and height % reduce == 0
    assert mean_abs(images.shrink(reduced, target), full) < (0.5 if aligned else 2.0)
    stored, w0, h0 = images.repack_image(data, size)
    assert (w0, h0) == (width, height)
    out = decoded(stored)
    reference = full_reference(data, size)
    assert out.shape == reference.shape == (target[1], target[0], 3)
    assert mean_abs(out, reference) < (1.0 if aligned else 2.5)


def test_stored_reduction_never_leaves_a_side_short():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        w, h = (int(v) for v in rng.integers(1, 6000, 2))
        size = int(rng.choice([64, 256, 512, 1024]))
        target = buckets.stored_size(w, h, size)
        k = images.stored_reduction((w, h), target)
        assert -(-w // k) >= target[0] and -(-h // k) >= target[1], (w, h, size, k)
        if k < 8:  # the next reduction would leave a side short
            assert w < 2 * k * target[0] or h < 2 * k * target[1], (w, h, size, k)


def test_exif_orientation_is_applied_before_the_size_is_kept():
    displayed = smooth(80, 96)  # portrait as displayed, stored turned
    data = bad.exif_rotated_jpeg(displayed, 6)
    stored, width, height = images.repack_image(data, 64)
    assert (width, height) == (80, 96)
    out = decoded(stored)
    assert out.shape[:2] == buckets.stored_size(80, 96, 64)[::-1] == (76, 64)
    assert np.abs(out[:10, :10].astype(int) - bad.RED).max() <= 30  # red corner up-left


def test_an_extreme_aspect_image_is_still_dropped():
    for data in (bad.jpeg(2000, 20), bad.encode(bad.canvas(20, 3000), "PNG")):
        with pytest.raises(images.Unusable) as e:
            images.repack_image(data, 64)
        assert e.value.reason == "extreme_aspect"


def test_the_other_drop_rules_hold():
    cases = {
        "truncated": bad.truncated_jpeg(),
        "decode_error": bad.not_an_image(),
        "too_large": bad.png_bomb(),
        "too_small": bad.tiny_jpeg(16),
    }
    for reason, data in cases.items():
        with pytest.raises(images.Unusable) as e:
            images.repack_image(data, 64, min_side=32)
        assert e.value.reason == reason
    # Under the size floor although the stored image would be small anyway: a PNG (no header
    # check before the decode) is measured after it.
    with pytest.raises(images.Unusable) as e:
        images.repack_image(bad.encode(bad.canvas(20, 100), "PNG"), 64, min_side=32)
    assert e.value.reason == "too_small"
    with pytest.raises(images.Unusable) as e:
        images.repack_image(bad.jpeg(100, 100), 64, crop=(200, 200, 50, 50))
    assert e.value.reason == "empty_crop"


def test_a_crop_box_is_cut_before_the_resize():
    rgb = smooth(400, 300)
    data = jpeg(rgb)
    box = (50, 20, 200, 200)  # a square around a person, as COCO's adapter gives it
    stored, width, height = images.repack_image(data, 64, crop=box)
    assert (width, height) == (400, 300)  # the sample table's size is the image's, not the box's
    out = decoded(stored)
    assert out.shape == (64, 64, 3)
    assert mean_abs(out, full_reference(data, 64, box)) < 2.0
    # A box not square, and one under size²: kept as cut.
    out = decoded(images.repack_image(data, 64, crop=(0, 0, 300, 100))[0])
    assert out.shape[:2] == buckets.stored_size(300, 100, 64)[::-1]
    out = decoded(images.repack_image(data, 64, crop=(100, 100, 40, 40))[0])
    assert out.shape == (40, 40, 3)
    assert mean_abs(out, rgb[100:140, 100:140]) < 2.0


def test_a_crop_box_of_a_big_jpeg_decoded_reduced():
    data = jpeg(smooth(1600, 1200, seed=3))
    box = (400, 296, 800, 800)  # 800 >= 8 x 64: decoded reduced by 8, on block edges
    assert images.stored_reduction(box[2:], (64, 64)) == 8
    out = decoded(images.repack_image(data, 64, crop=box)[0])
    assert out.shape == (64, 64, 3)
    assert mean_abs(out, full_reference(data, 64, box)) < 1.0


def test_a_crop_box_leaving_the_image_is_padded():
    rgb = smooth(200, 200)
    out = decoded(images.repack_image(jpeg(rgb), 64, crop=(-40, -40, 128, 128))[0])
    assert out.shape == (64, 64, 3)
    corner = out[:16, :16].astype(int)  # the box's top-left quarter is outside the image
    assert np.abs(corner - images.PAD_FILL).max() <= 6


def test_readers_still_get_squares_of_what_is_stored():
    stored, _, _ = images.repack_image(jpeg(smooth(1920, 1080)), 64)
    assert decoded(stored).shape == (64, 113, 3)
    square = images.decode_image(stored, 64)
    assert square.shape == (64, 64, 3) and square.dtype == np.uint8


@pytest.mark.parametrize("side", [64, 200, 1024, 2100])
def test_a_square_at_least_size_is_stored_as_the_readers_square(side):
    """For a square image the shards hold what they held before aspect buckets: the reader's
    `size` x `size` square, the same bytes (so square sources keep their latents)."""
    data = jpeg(smooth(side, side))
    square = images.decode_image(data, 64)
    ok, want = cv2.imencode(
        ".jpg", cv2.cvtColor(square, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95]
    )
    assert ok and images.repack_image(data, 64)[0] == want.tobytes()
