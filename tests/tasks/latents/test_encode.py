"""encode: pixels follow the stated rules, latents equal a plain one-image-at-a-time reference.

The reference is written independently with PIL (decode, `draft` for the reduced JPEG decode,
EXIF transpose, alpha over white), cv2's resize and the diffusers VAE in fp32, one image at a
time. Also here: fetch-metadata's column check, the other place a shard's input is unusable.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import queue
import sys
import tarfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageOps

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from sdtrain.atomic import TMP_MARK
from sdtrain.models import build_vae
from tasks.latents import encode, images, latent_keys
from tasks.runtime.shards import ShardStats, failure_path
from tasks.sources import metadata
from tasks.sources.table import SourceError

SOURCE = "src"
SHARD = "00000"


@pytest.fixture(scope="module")
def tiny():
    """The catalog's tiny model without its bucket plan: this file tests the legacy layout (one
    square per image, `NNNNN.npy` [N, 4, 8, 8]); test_encode_buckets.py tests the buckets."""
    model = dataclasses.replace(load_catalog(PACKAGED_DIR).model("tiny"), buckets=None)
    assert encode.LatentSpec.of(model).legacy
    return model


@pytest.fixture(scope="module")
def reference_vae(tiny):
    """The tiny VAE built afresh: the stage's own copy must have the same weights."""
    return build_vae(tiny).eval().requires_grad_(False)


def texture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A smooth random texture, so a shifted crop or swapped channels changes the latents."""
    return cv2.GaussianBlur(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), (0, 0), 1.5)


def encoded(pixels: np.ndarray, mode: str, fmt: str, **save) -> bytes:
    img = Image.fromarray(pixels)
    if mode == "RGBA":  # an alpha ramp, so the matte rule shows
        ramp = np.linspace(0, 255, pixels.shape[1], dtype=np.uint8)
        img.putalpha(Image.fromarray(np.tile(ramp, (pixels.shape[0], 1))))
    elif mode == "P+alpha":
        img = img.convert("P")
        save["transparency"] = 0
    else:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def rotated_exif() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return exif.tobytes()


# key -> (width, height, mode, format, save options): crops both ways, upscales, an exact fit,
# JPEGs 2x, 4x and 8x the model side (decoded reduced), EXIF rotation, grayscale, palette and
# alpha (composited over white), lossless WebP, CMYK.
IMAGES = {
    "wide": (200, 120, "RGB", "JPEG", {}),
    "tall": (97, 131, "RGB", "JPEG", {}),
    "small": (50, 90, "RGB", "PNG", {}),
    "exact": (64, 64, "RGB", "PNG", {}),
    "gray": (80, 70, "L", "PNG", {}),
    "gray_jpeg": (90, 80, "L", "JPEG", {}),
    "alpha": (100, 300, "RGBA", "PNG", {}),
    "palette": (70, 90, "P+alpha", "PNG", {}),
    "panorama": (640, 70, "RGB", "JPEG", {}),
    "reduced2": (200, 150, "RGB", "JPEG", {"subsampling": 2}),
    "reduced4": (300, 270, "RGB", "JPEG", {"quality": 95}),
    "reduced8": (600, 520, "RGB", "JPEG", {}),
    "rotated": (300, 260, "RGB", "JPEG", {"exif": rotated_exif()}),
    "webp": (100, 80, "RGB", "WEBP", {"lossless": True}),
    "cmyk": (90, 80, "CMYK", "JPEG", {}),
}


@pytest.fixture(scope="module")
def samples() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {
        key: encoded(texture(rng, w, h), mode, fmt, **save)
        for key, (w, h, mode, fmt, save) in IMAGES.items()
    }


def reference_pixels(data: bytes, size: int) -> np.ndarray:
    """The stated transform, with PIL decoding: reduce, orient, matte, resize short side, crop."""
    img = Image.open(io.BytesIO(data))
    if img.format == "JPEG":
        k = next((k for k in (8, 4, 2) if min(img.size) >= k * size), 1)
        if k > 1:
            img.draft("RGB", (img.width // k, img.height // k))
        img = ImageOps.exif_transpose(img)
    if img.mode == "CMYK":
        # The samples as stored (Adobe inverted), then the stated rule, OpenCV's integer form.
        stored = 255 - np.asarray(img).astype(np.int32)
        ink, k = stored[..., :3], stored[..., 3:]
        rgb = (k - ((255 - ink) * k >> 8)).astype(np.uint8)
    elif img.mode in ("RGBA", "LA") or "transparency" in img.info:
        rgba = np.asarray(img.convert("RGBA")).astype(np.uint32)
        alpha = rgba[..., 3:]
        rgb = ((rgba[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    else:
        rgb = np.asarray(img.convert("RGB"))
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


@pytest.fixture(scope="module")
def reference_latents(samples, tiny, reference_vae) -> dict[str, np.ndarray]:
    return {k: reference_latent(reference_vae, d, tiny.resolution) for k, d in samples.items()}


def assert_close_to_reference(latent: np.ndarray, reference: np.ndarray, key: str = "") -> None:
    # fp16 storage: equal within 1% of the latents' spread.
    np.testing.assert_allclose(
        latent.astype(np.float32),
        reference,
        rtol=0,
        atol=1e-2 * float(reference.std()),
        err_msg=key,
    )


# ---- decode rules ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(IMAGES))
def test_load_image_follows_the_stated_rule(samples, tiny, key):
    pixels = encode.load_image(samples[key], tiny.resolution)
    assert pixels.dtype == np.uint8
    assert pixels.shape == (tiny.resolution, tiny.resolution, 3)
    np.testing.assert_array_equal(pixels, reference_pixels(samples[key], tiny.resolution))


def test_exif_rotation_is_applied(samples, tiny):
    stored = np.asarray(Image.open(io.BytesIO(samples["rotated"])).convert("RGB"))
    upright = images.decode_rgb(samples["rotated"], tiny.resolution)
    assert upright.shape[:2] == (stored.shape[1] // 4, stored.shape[0] // 4)  # turned, 4x reduced


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_16_bit_samples_keep_their_high_byte(tiny, channels):
    rgb = texture(np.random.default_rng(channels), 90, 70)
    code = {1: cv2.COLOR_RGB2GRAY, 3: cv2.COLOR_RGB2BGR, 4: cv2.COLOR_RGB2BGRA}[channels]
    eight_bit = cv2.cvtColor(rgb, code)
    ok, png16 = cv2.imencode(".png", eight_bit.astype(np.uint16) * 257)
    ok8, png8 = cv2.imencode(".png", eight_bit)
    assert ok and ok8
    np.testing.assert_array_equal(
        encode.load_image(png16.tobytes(), tiny.resolution),
        encode.load_image(png8.tobytes(), tiny.resolution),
    )


def bad_inputs(samples: dict[str, bytes]) -> dict[str, tuple[bytes, str]]:
    """Inputs no rule converts -> (bytes, the reason they are dropped under)."""
    ok, float_tiff = cv2.imencode(".tiff", np.zeros((80, 80, 3), np.float32))
    ok2, sliver = cv2.imencode(".png", np.zeros((1, 100, 3), np.uint8))
    assert ok and ok2
    return {
        "html": (b"<html>this is an error page, not a JPEG</html>\n" * 20, "decode_error"),
        "empty": (b"", "decode_error"),
        "garbage_jpeg": (b"\xff\xd8\xff\xe0" + bytes(300) + b"\xff\xd9", "decode_error"),
        "truncated_jpeg": (samples["wide"][: len(samples["wide"]) // 2], "truncated"),
        "jpeg_header_only": (samples["wide"][:200], "truncated"),
        "truncated_png": (samples["small"][: len(samples["small"]) // 2], "truncated"),
        "truncated_webp": (samples["webp"][:-10], "truncated"),
        "float_tiff": (float_tiff.tobytes(), "unsupported_depth"),
        "sliver": (sliver.tobytes(), "extreme_aspect"),
    }


def test_bad_inputs_are_dropped_under_their_reason(samples, tiny):
    for name, (data, reason) in bad_inputs(samples).items():
        with pytest.raises(images.Unusable) as info:
            images.decode_image(data, tiny.resolution)
        assert info.value.reason == reason, name
        assert encode.load_image(data, tiny.resolution) is None


def test_an_image_that_breaks_the_decoder_drops_only_itself(samples, tiny, monkeypatch):
    real = images.decode_image

    def decode_image(data, size):
        if data == samples["tall"]:
            raise MemoryError("a decoder blew up")
        return real(data, size)

    monkeypatch.setattr(images, "decode_image", decode_image)
    rows, pixels, dropped = images.decode_rows(
        [(0, samples["wide"]), (1, samples["tall"]), (2, b"junk"), (3, samples["gray"])], 64
    )
    assert rows == [0, 3]
    assert pixels.shape == (2, 64, 64, 3)
    assert dropped == {1: "decode_error", 2: "decode_error"}


# A worker whose decoder dies (as a segfault would) on the bytes b"crash".
CRASHING_WORKER = (
    sys.executable,
    "-c",
    "import os, tasks.latents.images as m\n"
    "def decode_rows(items, size):\n"
    "    if any(data == b'crash' for _, data in items):\n"
    "        os._exit(139)\n"
    "    return m.decode_rows(items, size)\n"
    "m.WORKER_TASKS['decode'] = decode_rows\n"
    "m.serve()\n",
)


def test_an_image_that_kills_its_decode_worker_drops_only_itself(samples, tiny):
    pool = images.DecodePool(1, command=CRASHING_WORKER)
    try:
        items = [(0, samples["wide"]), (1, b"crash"), (2, samples["gray"])]
        rows, pixels, dropped = pool.submit(items, tiny.resolution).result()
        assert (rows, dropped) == ([0, 2], {1: "decoder_crash"})
        np.testing.assert_array_equal(pixels[1], reference_pixels(samples["gray"], 64))
        # The pool goes on with a new worker.
        rows, _, dropped = pool.submit([(5, samples["tall"])], tiny.resolution).result()
        assert (rows, dropped) == ([5], {})
    finally:
        pool.close()


# ---- latents --------------------------------------------------------------------------------


def test_encode_images_equals_one_at_a_time_fp32_reference(samples, tiny, reference_latents):
    vae = build_vae(tiny).eval()
    batch = np.stack([encode.load_image(data, tiny.resolution) for data in samples.values()])
    latents = encode.encode_images(vae, batch, tiny.scaling_factor)
    side = tiny.resolution // 8
    assert latents.dtype == np.float16
    assert latents.shape == (len(samples), 4, side, side)
    for latent, key in zip(latents, samples, strict=True):
        assert_close_to_reference(latent, reference_latents[key], key)


def write_shard(root: Path, members: dict[str, bytes], token_keys: list[str], shard=SHARD):
    """A fetched shard tar (key.jpg/png, key.txt, key.json) and its token table."""
    shards, tokens = root / SOURCE / "shards", root / SOURCE / "tokens"
    shards.mkdir(parents=True, exist_ok=True)
    tokens.mkdir(parents=True, exist_ok=True)
    with tarfile.open(shards / f"{shard}.tar", "w") as tar:
        for key, data in members.items():
            ext = "png" if data.startswith(b"\x89PNG") else "jpg"  # WebP as .jpg: bytes decide
            for name, payload in (
                (f"{key}.{ext}", data),
                (f"{key}.txt", b"a caption"),
                (f"{key}.json", json.dumps({"key": key}).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    pq.write_table(
        pa.table(
            {
                "key": token_keys,
                "input_ids": pa.array([[0] * 77] * len(token_keys), pa.list_(pa.int32(), 77)),
            }
        ),
        tokens / f"{shard}.parquet",
    )


def test_encode_shard_rows_follow_keys_and_bad_images_are_dropped(
    tmp_path, samples, tiny, reference_latents
):
    bad = bad_inputs(samples)
    members = dict(samples) | {name: data for name, (data, _) in bad.items()}
    # Token order differs from the tar's, bad images sit between good ones (holes in the
    # batches), and one token key has no image in the tar.
    token_keys = list(samples)[::-1] + ["gone"]
    for i, name in enumerate(bad):
        token_keys.insert(2 * i + 1, name)
    write_shard(tmp_path, members, token_keys)

    stats = encode.encode_shard(tmp_path, SOURCE, SHARD, tiny, batch_size=4)

    expected = {"missing_image": 1}
    for _, reason in bad.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert stats.dropped == expected
    assert (stats.num_in, stats.num_out) == (len(token_keys), len(samples))
    kept = [k for k in token_keys if k in samples]
    written = latent_keys.read(tmp_path, SOURCE, SHARD)  # the keys file, not the record
    assert written["key"].to_pylist() == kept and "keys" not in stats.extra
    assert written["token_row"].to_pylist() == [token_keys.index(k) for k in kept]
    assert written["token_row"].type == pa.int32()
    latents = np.load(tmp_path / SOURCE / "latents" / f"{SHARD}.npy")
    assert latents.dtype == np.float16
    assert latents.shape == (len(kept), 4, tiny.resolution // 8, tiny.resolution // 8)
    for row, key in enumerate(kept):
        assert_close_to_reference(latents[row], reference_latents[key], key)
    assert stats.extra["latent_mean"] == pytest.approx(float(latents.astype(np.float32).mean()))
    assert stats.extra["latent_std"] == pytest.approx(float(latents.astype(np.float32).std()))
    assert not [p for p in tmp_path.rglob("*") if TMP_MARK in p.name]


def test_encode_shard_where_no_image_decodes_writes_zero_rows(tmp_path, tiny):
    write_shard(tmp_path, {"broken": b"not an image"}, ["broken"])
    stats = encode.encode_shard(tmp_path, SOURCE, SHARD, tiny)
    latents = np.load(tmp_path / SOURCE / "latents" / f"{SHARD}.npy")
    assert stats.dropped == {"decode_error": 1}
    assert latent_keys.read(tmp_path, SOURCE, SHARD).num_rows == 0
    assert latents.shape == (0, 4, tiny.resolution // 8, tiny.resolution // 8)


@pytest.fixture(scope="module")
def four_shards(tmp_path_factory, samples) -> tuple[Path, list[str]]:
    """Shards of 7, 0 (no image in the tar), 3 (one broken) and 5 images."""
    root = tmp_path_factory.mktemp("shards")
    keys = list(samples)
    layout = {"00000": keys[:7], "00001": [], "00002": keys[7:10], "00003": keys[10:]}
    for shard, shard_keys in layout.items():
        members = {f"{shard}-{k}": samples[k] for k in shard_keys}
        if shard == "00002":
            members[f"{shard}-broken"] = b"broken"
        token_keys = list(members) if shard_keys else ["00001-a", "00001-b"]
        write_shard(root, members, token_keys, shard)
    return root, list(layout)


def read_outputs(root: Path, shards: list[str]) -> dict[str, tuple[np.ndarray, dict]]:
    out = {}
    for s in shards:
        stats = ShardStats.read(root / SOURCE / "latents" / f"{s}.stats.json")
        latents = np.load(root / SOURCE / "latents" / f"{s}.npy")
        written = latent_keys.read(root, SOURCE, s).to_pydict()
        out[s] = (
            latents,
            {"keys": written["key"], "token_rows": written["token_row"]} | stats.dropped,
        )
    return out


def assert_same_outputs(a: dict, b: dict, *, exact: bool) -> None:
    assert a.keys() == b.keys()
    for shard, (latents, record) in a.items():
        assert record == b[shard][1], shard
        if exact:
            np.testing.assert_array_equal(latents, b[shard][0], err_msg=shard)
        else:  # other thread counts may round differently: within fp16 precision
            np.testing.assert_allclose(latents, b[shard][0], rtol=2e-3, atol=2e-3, err_msg=shard)


def test_one_pipeline_over_shards_equals_shard_by_shard_and_resumes(tmp_path, four_shards, tiny):
    src_root, shards = four_shards
    one_by_one, pipelined = tmp_path / "a", tmp_path / "b"
    for root in (one_by_one, pipelined):
        (root / SOURCE).mkdir(parents=True)
        for stage in ("shards", "tokens"):
            (root / SOURCE / stage).symlink_to(src_root / SOURCE / stage)
    for s in shards:
        encode.encode_shard(one_by_one, SOURCE, s, tiny, batch_size=4)
    stats = encode.encode_shards(pipelined, SOURCE, shards, tiny, batch_size=4)

    assert [s.shard for s in stats] == shards
    assert [s.num_out for s in stats] == [7, 0, 3, 5]
    assert stats[1].dropped == {"missing_image": 2}
    # Same bits whatever the shard was batched after: what makes a resumed run match.
    assert_same_outputs(
        read_outputs(one_by_one, shards), read_outputs(pipelined, shards), exact=True
    )

    latents_dir = pipelined / SOURCE / "latents"
    mtimes = {p.name: p.stat().st_mtime_ns for p in latents_dir.iterdir()}
    (latents_dir / "00002.stats.json").unlink()  # as if killed before shard 2 was recorded
    again = encode.encode_shards(pipelined, SOURCE, shards, tiny, batch_size=4)
    assert [s.skipped for s in again] == [True, True, False, True]
    assert {n: t for n, t in mtimes.items() if not n.startswith("00002")} == {
        p.name: p.stat().st_mtime_ns
        for p in latents_dir.iterdir()
        if not p.name.startswith("00002")
    }
    assert_same_outputs(
        read_outputs(one_by_one, shards), read_outputs(pipelined, shards), exact=True
    )


def test_one_encoder_per_device_equals_the_single_process_path(tmp_path, four_shards, tiny):
    src_root, shards = four_shards
    single, split = tmp_path / "single", tmp_path / "split"
    for root in (single, split):
        (root / SOURCE).mkdir(parents=True)
        for stage in ("shards", "tokens"):
            (root / SOURCE / stage).symlink_to(src_root / SOURCE / stage)
    encode.encode_shards(single, SOURCE, shards, tiny, batch_size=4)
    stats = encode.encode_on_devices(split, SOURCE, shards, tiny, ["cpu", "cpu"], batch_size=4)
    assert [s.shard for s in stats] == shards
    assert encode.partition(shards, 2) == [["00000", "00002"], ["00001", "00003"]]
    assert_same_outputs(read_outputs(single, shards), read_outputs(split, shards), exact=False)


def test_a_stream_yields_each_shard_before_the_next_comes_and_a_bad_one_fails_alone(
    tmp_path, four_shards, tiny
):
    """One long-lived encoder fed shard by shard (a device worker of build-latents): each
    shard is recorded without waiting for the next (which may be waiting on it), a shard
    whose inputs are missing fails alone, and the record names the device."""
    src_root, shards = four_shards
    (tmp_path / SOURCE).mkdir()
    for stage in ("shards", "tokens"):
        (tmp_path / SOURCE / stage).symlink_to(src_root / SOURCE / stage)
    given: queue.Queue = queue.Queue()
    stream = encode.encode_stream(
        tmp_path, SOURCE, iter(given.get, None), tiny, batch_size=4, device="cpu:1"
    )
    with ThreadPoolExecutor(1) as driver:

        def step():
            return driver.submit(next, stream).result(timeout=120)

        given.put("00000")
        shard, stats = step()
        assert (shard, stats.num_out, stats.extra["device"]) == ("00000", 7, "cpu:1")
        assert stats.seconds > 0
        given.put("00009")  # no such shard
        shard, error = step()
        assert shard == "00009" and isinstance(error, FileNotFoundError)
        assert failure_path(tmp_path, SOURCE, "latents", "00009").is_file()
        given.put("00000")  # done already: skipped, not encoded again
        given.put("00003")
        given.put(None)
        rest = driver.submit(list, stream).result(timeout=120)
    assert [(s, st.skipped, st.num_out) for s, st in rest] == [
        ("00000", True, 7),
        ("00003", False, 5),
    ]


def test_encoding_on_cpu_leaves_the_torch_thread_setting_alone(tmp_path, four_shards, tiny):
    src_root, shards = four_shards
    (tmp_path / SOURCE).mkdir()
    for stage in ("shards", "tokens"):
        (tmp_path / SOURCE / stage).symlink_to(src_root / SOURCE / stage)
    before = torch.get_num_threads()
    encode.encode_shards(tmp_path, SOURCE, shards, tiny, batch_size=4)  # runs in one-thread lanes
    in_a_new_thread = []
    thread = threading.Thread(target=lambda: in_a_new_thread.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == before
    assert in_a_new_thread == [before]


def test_latent_qa_decodes_a_stated_sample(tmp_path, four_shards, tiny, reference_vae):
    src_root, shards = four_shards
    (tmp_path / SOURCE).mkdir()
    for stage in ("shards", "tokens"):
        (tmp_path / SOURCE / stage).symlink_to(src_root / SOURCE / stage)
    stats = encode.encode_shards(tmp_path, SOURCE, shards, tiny, batch_size=4)

    qa = encode.latent_qa(tmp_path, SOURCE, tiny, num_samples=4, seed=3)

    assert json.loads((tmp_path / SOURCE / "latents" / encode.QA_FILE).read_text()) == qa
    assert encode.latent_qa(tmp_path, SOURCE, tiny, num_samples=4, seed=3) == qa  # stated
    assert len(qa["samples"]) == 4 and qa["num_latents"] == 15
    everything = np.concatenate(
        [np.load(tmp_path / SOURCE / "latents" / f"{s}.npy") for s in shards]
    ).astype(np.float32)
    assert qa["latent_mean"] == pytest.approx(float(everything.mean()), abs=1e-5)
    assert qa["latent_std"] == pytest.approx(float(everything.std()), rel=1e-4)
    # Each PSNR is that of the VAE's decode of the stored latent against the input pixels.
    keys = {s.shard: latent_keys.read(tmp_path, SOURCE, s.shard)["key"].to_pylist() for s in stats}
    for sample in qa["samples"]:
        row = keys[sample["shard"]].index(sample["key"])
        latent = np.load(tmp_path / SOURCE / "latents" / f"{sample['shard']}.npy")[row]
        with torch.no_grad():
            z = torch.from_numpy(latent.astype(np.float32))[None] / tiny.scaling_factor
            decoded = reference_vae.decode(z).sample[0].clamp(-1, 1).add(1).mul(127.5)
        data = encode.read_images(
            tmp_path / SOURCE / "shards" / f"{sample['shard']}.tar", {sample["key"]}
        )[sample["key"]]
        target = torch.from_numpy(reference_pixels(data, tiny.resolution).copy()).float()
        mse = (decoded - target.permute(2, 0, 1)).pow(2).mean().item()
        assert sample["psnr_db"] == pytest.approx(10 * math.log10(255**2 / mse), abs=0.01)


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
    # Only the failure record (read by `sdpipe status`): no output, no done record.
    assert [p.name for p in stage_dir.iterdir()] == ["00000.failed.json"]
    assert (
        "missing required column"
        in json.loads((stage_dir / "00000.failed.json").read_text())["message"]
    )
