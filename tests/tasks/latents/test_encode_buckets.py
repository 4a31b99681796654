"""encode with a latent spec (docs/training-data.md, "Latents on disk"): a file per shard and
bucket, flips encoded by the VAE on the mirrored image, the posterior's log-variance, and a
shard done only under the spec it was encoded with.

References are independent: PIL decodes, the nearest bucket is computed here from the plan's
sizes, cv2 resizes to cover, and the diffusers VAE encodes one image at a time in fp32.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from catalog import CatalogError, load_catalog, needs_flips
from catalog.buckets import BucketPlan
from catalog.loader import PACKAGED_DIR
from sdtrain.atomic import TMP_MARK
from sdtrain.models import build_vae
from tasks.latents import encode, images, latent_keys
from tasks.runtime.shards import ShardStats
from tests.tasks.latents.test_encode import SOURCE, texture, write_shard
from tests.tasks.latents.test_encode import assert_close_to_reference as assert_close

SHARD = "00000"
PLAN = {"area": 64 * 64, "step": 16, "min_side": 32, "max_side": 128, "max_aspect": 2}
BUCKETS = ["48x80", "64x64", "80x48"]  # the plan's buckets, by aspect ratio up

# key -> (width, height, format) as a repacked shard stores them (aspect kept): wide, tall and
# square, shrunk and grown into their buckets, aspect ratios between two buckets.
STORED = {
    "wide": (100, 60, "JPEG"),
    "tall": (60, 100, "JPEG"),
    "square": (64, 64, "JPEG"),
    "small": (40, 30, "PNG"),
    "pano": (128, 60, "PNG"),
    "portrait": (45, 90, "JPEG"),
    "near_square": (70, 60, "JPEG"),
    "wide2": (90, 50, "PNG"),
    "tall2": (50, 84, "PNG"),
    # Larger than the plan needs 4x over: decoded reduced (libjpeg's DCT scaling, PIL's draft).
    "big": (600, 400, "JPEG"),
}


@pytest.fixture(scope="module")
def tiny():
    """The catalog's tiny model without its bucket plan (the legacy layout); `bucketed` is it
    with PLAN."""
    model = dataclasses.replace(load_catalog(PACKAGED_DIR).model("tiny"), buckets=None)
    assert encode.LatentSpec.of(model).legacy
    return model


@pytest.fixture(scope="module")
def bucketed(tiny):
    return dataclasses.replace(tiny, buckets=PLAN)


@pytest.fixture(scope="module")
def reference_vae(tiny):
    return build_vae(tiny).eval().requires_grad_(False)


def image_bytes(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def stored() -> dict[str, bytes]:
    rng = np.random.default_rng(5)
    return {k: image_bytes(texture(rng, w, h), fmt) for k, (w, h, fmt) in STORED.items()}


def reference_bucket(data: bytes) -> tuple[str, np.ndarray]:
    """(bucket, pixels): PIL decode (a JPEG reduced by the largest of 8, 4, 2 that keeps the
    short side the cover resize asks for), nearest aspect among the plan's buckets, cover,
    center crop."""
    sizes = [tuple(int(v) for v in b.split("x")) for b in BUCKETS]

    def nearest(w, h):
        return min(sizes, key=lambda s: (abs(s[0] / s[1] - w / h), s[0] / s[1]))

    img = Image.open(io.BytesIO(data))
    if img.format == "JPEG":
        bw, bh = nearest(*img.size)
        need = math.ceil(min(img.size) * max(bw / img.width, bh / img.height))
        k = next((k for k in (8, 4, 2) if min(img.size) >= k * need), 1)
        if k > 1:
            img.draft("RGB", (img.width // k, img.height // k))
    rgb = np.asarray(img.convert("RGB"))
    h, w = rgb.shape[:2]
    bw, bh = nearest(w, h)
    scale = max(bw / w, bh / h)
    new_w, new_h = max(bw, round(w * scale)), max(bh, round(h * scale))
    if (new_w, new_h) != (w, h):
        interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC
        rgb = cv2.resize(rgb, (new_w, new_h), interpolation=interpolation)
    top, left = (new_h - bh) // 2, (new_w - bw) // 2
    return f"{bw}x{bh}", rgb[top : top + bh, left : left + bw]


@torch.no_grad()
def reference_posterior(vae, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 (mean x 0.18215, logvar + 2 ln 0.18215) of one image [H, W, 3]."""
    x = (torch.from_numpy(pixels.copy()).float() / 127.5 - 1.0).permute(2, 0, 1)[None]
    dist = vae.encode(x).latent_dist
    return (dist.mean * 0.18215)[0].numpy(), (dist.logvar + 2 * math.log(0.18215))[0].numpy()


# The encodes compared with the fp32 reference run on the CPU, in fp32, wherever the suite runs:
# on a GPU the encoder autocasts to bf16 (seen on an H100: 0.003 off, past 1% of the spread).
EXACT = "cpu"


def token_order() -> list[str]:
    """Token keys: not the tar's order, a broken image between good ones, one with no image."""
    keys = list(STORED)[::-1]
    keys.insert(3, "broken")
    return [*keys, "gone"]


def make_shard(root: Path, stored: dict[str, bytes], shard: str = SHARD) -> None:
    members = dict(stored) | {"broken": b"not an image"}
    write_shard(root, members, token_order(), shard)


def spec_of(model, **kw) -> encode.LatentSpec:
    return encode.LatentSpec.of(model, **kw)


def read_bucketed(root: Path, shard: str = SHARD) -> tuple[pa.Table, dict[str, np.ndarray]]:
    table = latent_keys.read(root, SOURCE, shard)
    files = {
        b: np.load(latent_keys.latents_path(root, SOURCE, shard, b))
        for b in sorted(set(table["bucket"].to_pylist()))
    }
    return table, files


# ---- decode into buckets ---------------------------------------------------------------------


def test_the_plan_has_the_buckets_the_references_assume():
    assert BucketPlan.from_dict(PLAN, 64).names() == BUCKETS


@pytest.mark.parametrize("key", list(STORED))
def test_decode_to_bucket_follows_the_stated_rule(stored, key):
    bucket, pixels = images.decode_to_bucket(stored[key], PLAN)
    want_bucket, want = reference_bucket(stored[key])
    assert BUCKETS[bucket] == want_bucket
    np.testing.assert_array_equal(pixels, want)


def test_decode_bucketed_drops_bad_images_under_their_reason(stored):
    rows, payload, dropped = images.decode_bucketed(
        [(0, stored["wide"]), (1, b"junk"), (2, stored["tall"])], 0, plan=PLAN
    )
    assert rows == [0, 2] and dropped == {1: "decode_error"}
    assert [BUCKETS[b] for b, _ in payload] == ["80x48", "48x80"]
    assert [p.shape for _, p in payload] == [(48, 80, 3), (80, 48, 3)]


# ---- the per-bucket layout -------------------------------------------------------------------


def test_a_bucketed_shard_writes_a_file_per_bucket_and_keys_that_index_them(
    tmp_path, stored, bucketed, reference_vae
):
    make_shard(tmp_path, stored)
    # One sample-table row per image, with the image's digest; "tall" has none recorded.
    digests = {k: f"sha-{k}" for k in STORED if k != "tall"}
    pq.write_table(
        pa.table({"key": list(digests), "sha256": list(digests.values())}),
        tmp_path / SOURCE / "shards" / f"{SHARD}.parquet",
    )
    spec = spec_of(bucketed)
    assert not spec.legacy and (spec.views, spec.channels) == (1, 4)

    stats = encode.encode_shard(
        tmp_path, SOURCE, SHARD, bucketed, batch_size=2, spec=spec, device=EXACT
    )

    assert stats.dropped == {"decode_error": 1, "missing_image": 1}
    assert (stats.num_in, stats.num_out) == (len(STORED) + 2, len(STORED))
    table, files = read_bucketed(tmp_path)
    assert table.schema.names == ["key", "token_row", "bucket", "bucket_row", "sha256"]
    assert latent_keys.spec(table) == spec.to_dict() == stats.extra["latent_spec"]
    # mix's checks of the keys against the tokens file read this layout too.
    assert latent_keys.tokens_unchanged(tmp_path, SOURCE, SHARD, table)
    assert latent_keys.tokens_match(tmp_path, SOURCE, SHARD, table)
    kept = [k for k in token_order() if k in STORED]
    assert table["key"].to_pylist() == kept  # every key once, in token order
    assert table["token_row"].to_pylist() == [token_order().index(k) for k in kept]
    assert table["sha256"].to_pylist() == [digests.get(k, "") for k in kept]
    assert not (tmp_path / SOURCE / "latents" / f"{SHARD}.npy").exists()
    assert stats.extra["buckets"] == {b: len(z) for b, z in files.items()}
    for bucket, z in files.items():
        w, h = (int(v) for v in bucket.split("x"))
        assert z.dtype == np.float16 and z.shape == (len(z), 1, 4, h // 8, w // 8)
        rows = table.filter(pa.compute.equal(table["bucket"], bucket))["bucket_row"]
        assert sorted(rows.to_pylist()) == list(range(len(z)))  # each row of the file once
    for key, bucket, row in zip(
        kept, table["bucket"].to_pylist(), table["bucket_row"].to_pylist(), strict=True
    ):
        want_bucket, pixels = reference_bucket(stored[key])
        assert bucket == want_bucket, key
        assert_close(files[bucket][row, 0], reference_posterior(reference_vae, pixels)[0], key)
    assert not [p for p in tmp_path.rglob("*") if TMP_MARK in p.name]
    assert encode.shard_done(tmp_path, SOURCE, SHARD, spec)


def test_flips_are_the_vae_on_the_mirrored_image_and_logvar_is_stored(
    tmp_path, stored, bucketed, reference_vae
):
    make_shard(tmp_path / "a", stored)
    make_shard(tmp_path / "b", stored)
    plain = spec_of(bucketed)
    full = spec_of(bucketed, flips=True, sampling=True)
    assert (full.views, full.channels) == (2, 8)
    encode.encode_shard(
        tmp_path / "a", SOURCE, SHARD, bucketed, batch_size=4, spec=plain, device=EXACT
    )
    encode.encode_shard(
        tmp_path / "b", SOURCE, SHARD, bucketed, batch_size=4, spec=full, device=EXACT
    )

    table_a, mean_only = read_bucketed(tmp_path / "a")
    table, files = read_bucketed(tmp_path / "b")
    assert table.equals(table_a)  # same rows, buckets and bucket rows
    for key, bucket, row in zip(
        table["key"].to_pylist(),
        table["bucket"].to_pylist(),
        table["bucket_row"].to_pylist(),
        strict=True,
    ):
        z = files[bucket][row]
        h, w = (int(v) // 8 for v in bucket.split("x")[::-1])
        assert z.shape == (2, 8, h, w)
        _, pixels = reference_bucket(stored[key])
        mean, logvar = reference_posterior(reference_vae, pixels)
        mirrored_mean, mirrored_logvar = reference_posterior(reference_vae, pixels[:, ::-1])
        # View 1 is the VAE's output on the mirrored image: not view 0's latent flipped.
        assert_close(z[1, :4], mirrored_mean, key)
        assert not np.allclose(z[1, :4], z[0, :4, :, ::-1], atol=1e-2 * float(mean.std()))
        # Channels 0..3 are the mean, as without the log-variance; 4..7 the log-variance of
        # the scaled posterior.
        np.testing.assert_allclose(z[0, :4], mean_only[bucket][row, 0], rtol=0, atol=2e-3)
        assert_close(z[0, :4], mean, key)
        assert np.isfinite(z[:, 4:].astype(np.float32)).all()
        assert_close(z[0, 4:], logvar, key)
        assert_close(z[1, 4:], mirrored_logvar, key)


def test_bucketed_latents_are_the_same_bits_whatever_came_before(tmp_path, stored, bucketed):
    """A shard encoded alone equals the same shard encoded after another through one pipeline
    (batches never span shards or buckets): what makes a resumed run match."""
    spec = spec_of(bucketed, flips=True)
    alone, after = tmp_path / "alone", tmp_path / "after"
    make_shard(alone, stored, "00001")
    make_shard(after, {k: stored[k] for k in ("wide", "tall", "small")}, "00000")
    make_shard(after, stored, "00001")
    encode.encode_shard(alone, SOURCE, "00001", bucketed, batch_size=4, spec=spec)
    encode.encode_shards(after, SOURCE, ["00000", "00001"], bucketed, batch_size=4, spec=spec)
    table_a, files_a = read_bucketed(alone, "00001")
    table_b, files_b = read_bucketed(after, "00001")
    assert table_a.equals(table_b) and files_a.keys() == files_b.keys()
    for bucket in files_a:
        np.testing.assert_array_equal(files_a[bucket], files_b[bucket], err_msg=bucket)


def test_a_shard_encoded_under_another_spec_is_encoded_again(tmp_path, stored, tiny, bucketed):
    make_shard(tmp_path, stored)
    latents = tmp_path / SOURCE / "latents"
    legacy = spec_of(tiny)
    plain, flipped = spec_of(bucketed), spec_of(bucketed, flips=True)
    assert legacy.legacy and legacy.digest() != plain.digest() != flipped.digest()

    first = encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=plain)
    assert not first.skipped
    again = encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=plain)
    assert again.skipped
    assert not encode.shard_done(tmp_path, SOURCE, SHARD, flipped)

    redone = encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=flipped)
    assert not redone.skipped and redone.extra["latent_spec"] == flipped.to_dict()
    assert {z.shape[1] for z in read_bucketed(tmp_path)[1].values()} == {2}
    assert encode.shard_done(tmp_path, SOURCE, SHARD, flipped)

    # Back to the legacy layout: one `NNNNN.npy`, no bucket file left behind.
    back = encode.encode_shard(tmp_path, SOURCE, SHARD, tiny, batch_size=4)
    assert not back.skipped
    assert sorted(p.name for p in latents.glob("*.npy")) == [f"{SHARD}.npy"]
    assert latent_keys.read(tmp_path, SOURCE, SHARD).schema.names == ["key", "token_row"]
    assert encode.shard_done(tmp_path, SOURCE, SHARD, legacy)
    assert not encode.shard_done(tmp_path, SOURCE, SHARD, plain)
    # A legacy record of an older sdpipe (no spec recorded) is done under the legacy spec only.
    record = ShardStats.read(latents / f"{SHARD}.stats.json")
    del record.extra["latent_spec"]
    (latents / f"{SHARD}.stats.json").write_text(
        __import__("json").dumps(dataclasses.asdict(record))
    )
    assert encode.shard_done(tmp_path, SOURCE, SHARD, legacy)
    assert not encode.shard_done(tmp_path, SOURCE, SHARD, plain)


def test_a_shard_with_a_bucket_file_gone_is_not_done(tmp_path, stored, bucketed):
    make_shard(tmp_path, stored)
    spec = spec_of(bucketed)
    encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=spec)
    before = read_bucketed(tmp_path)
    latent_keys.latents_path(tmp_path, SOURCE, SHARD, "48x80").unlink()
    assert not encode.shard_done(tmp_path, SOURCE, SHARD, spec)
    redone = encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=spec)
    assert not redone.skipped
    after = read_bucketed(tmp_path)
    assert before[0].equals(after[0])
    for bucket, z in before[1].items():
        np.testing.assert_array_equal(z, after[1][bucket])


def test_the_legacy_spec_writes_todays_files(tmp_path, stored, tiny):
    """A model without buckets, no flips, no log-variance: `NNNNN.npy` [N, 4, h, w] and a keys
    file of key and token_row, the same bytes as encode without a spec."""
    for root, spec in ((tmp_path / "a", None), (tmp_path / "b", spec_of(tiny))):
        make_shard(root, stored)
        encode.encode_shard(root, SOURCE, SHARD, tiny, batch_size=4, spec=spec)
    a, b = (tmp_path / x / SOURCE / "latents" for x in "ab")
    assert sorted(p.name for p in a.iterdir() if not p.name.endswith(".stats.json")) == [
        f"{SHARD}.keys.arrow",
        f"{SHARD}.npy",
    ]
    z = np.load(a / f"{SHARD}.npy")
    assert z.dtype == np.float16 and z.shape == (len(STORED), 4, 8, 8)
    assert latent_keys.read(tmp_path / "a", SOURCE, SHARD).schema.names == ["key", "token_row"]
    assert (a / f"{SHARD}.npy").read_bytes() == (b / f"{SHARD}.npy").read_bytes()


def test_latent_qa_reads_the_bucketed_layout(tmp_path, stored, bucketed, reference_vae):
    make_shard(tmp_path, stored)
    spec = spec_of(bucketed, flips=True, sampling=True)
    encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=spec, device=EXACT)
    qa = encode.latent_qa(tmp_path, SOURCE, bucketed, num_samples=4, seed=1, device=EXACT)
    assert len(qa["samples"]) == 4 and qa["num_latents"] == len(STORED)
    table, files = read_bucketed(tmp_path)
    keys = table["key"].to_pylist()
    for sample in qa["samples"]:
        i = keys.index(sample["key"])
        bucket, row = table["bucket"][i].as_py(), table["bucket_row"][i].as_py()
        with torch.no_grad():
            z = torch.from_numpy(files[bucket][row, 0, :4].astype(np.float32))[None] / 0.18215
            decoded = reference_vae.decode(z).sample[0].clamp(-1, 1).add(1).mul(127.5)
        target = torch.from_numpy(reference_bucket(stored[sample["key"]])[1].copy()).float()
        mse = (decoded - target.permute(2, 0, 1)).pow(2).mean().item()
        assert sample["psnr_db"] == pytest.approx(10 * math.log10(255**2 / mse), abs=0.01)
    # The mean over view 0's scaled mean, as the legacy layout's.
    view0 = np.concatenate([z[:, 0, :4].ravel() for z in files.values()]).astype(np.float32)
    assert qa["latent_mean"] == pytest.approx(float(view0.mean()), abs=1e-5)
    assert qa["latent_std"] == pytest.approx(float(view0.std()), rel=1e-4)


# ---- the catalog decides the spec ------------------------------------------------------------


def test_the_catalog_decides_buckets_flips_and_sampling():
    catalog = load_catalog(PACKAGED_DIR)
    phase = next(iter(catalog.phases.values()))
    source = catalog.datasets[phase.mix[0].dataset].source
    assert not needs_flips(catalog, source)
    assert encode.spec_for(catalog, source).legacy
    flipping = dataclasses.replace(phase, flip_p=0.5)
    src = dataclasses.replace(catalog.sources[source], latent_sampling=True)
    model = catalog.models[src.model]
    edited = dataclasses.replace(
        catalog,
        phases={**catalog.phases, phase.name: flipping},
        sources={**catalog.sources, source: src},
        models={**catalog.models, model.name: dataclasses.replace(model, buckets=PLAN)},
    )
    assert needs_flips(edited, source)
    spec = encode.spec_for(edited, source)
    assert (spec.views, spec.channels, spec.legacy) == (2, 8, False)
    assert spec.to_dict()["plan"] == BucketPlan.from_dict(PLAN, model.resolution).to_dict()
    assert spec.to_dict()["vae"]["model"] == model.name


@pytest.mark.parametrize(
    ("buckets", "says"),
    [
        ("{step: 12}", "buckets: bucket step 12"),
        ("{stride: 64}", "buckets.stride: unknown field"),
        ("{step: sixty}", "buckets.step: expected an integer"),
        ("{min_side: 2000, max_side: 3000}", "buckets: bucket plan"),
    ],
)
def test_a_bad_bucket_plan_names_the_file_and_field(tmp_path, buckets, says):
    directory = tmp_path / "catalog"
    directory.mkdir()
    for path in PACKAGED_DIR.glob("*.yaml"):
        (directory / path.name).write_text(path.read_text())
    models = directory / "models.yaml"
    text = models.read_text()
    # The tiny entry's own plan (if any) replaced by the bad one: YAML keeps the last of two
    # equal keys, so a line added beside it might not be the one read.
    start = text.index("\ntiny:\n") + 1
    after = re.compile(r"^\S", re.M).search(text, start + 1)  # the next top-level entry
    end = after.start() if after else len(text)
    entry = re.sub(r"^  buckets:.*\n", "", text[start:end], flags=re.M)
    assert entry.startswith("tiny:\n  resolution: 64\n") and "buckets:" not in entry
    entry = entry.replace("  resolution: 64\n", f"  resolution: 64\n  buckets: {buckets}\n", 1)
    models.write_text(text[:start] + entry + text[end:])
    with pytest.raises(CatalogError) as info:
        load_catalog(directory)
    message = str(info.value)
    assert "models.yaml" in message and "tiny." in message and says in message, message


def test_a_bucketed_shard_where_no_image_decodes_writes_zero_rows(tmp_path, bucketed):
    write_shard(tmp_path, {"broken": b"not an image"}, ["broken"])
    spec = spec_of(bucketed, flips=True)
    stats = encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, spec=spec)
    assert stats.dropped == {"decode_error": 1} and stats.num_out == 0
    assert stats.extra["buckets"] == {} and stats.extra["latent_mean"] is None
    table = latent_keys.read(tmp_path, SOURCE, SHARD)
    assert table.num_rows == 0 and latent_keys.spec(table) == spec.to_dict()
    assert not list((tmp_path / SOURCE / "latents").glob("*.npy"))
    assert encode.shard_done(tmp_path, SOURCE, SHARD, spec)


def test_a_re_encode_under_another_spec_keeps_what_phase_sets_link(
    tmp_path, stored, bucketed, monkeypatch, capsys
):
    """Issue 26, item 2: a later phase turns flips on, the source is encoded again, and the
    earlier phase's set still reads its latents (kept under `latents/spec-<digest>/`) until
    `sdpipe prune-latents --yes` removes them, once no phase set links them."""
    import shutil

    from catalog import Catalog, Dataset, FilterProfile, MixEntry, Model, Source
    from flows.cli import main
    from sdtrain.data import PhaseSet
    from tasks.curation import views as views_stage
    from tasks.phases import mix
    from tests.tasks.phases.test_mix import phase

    make_shard(tmp_path, stored)
    plain, flipped = spec_of(bucketed), spec_of(bucketed, flips=True)
    encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=plain)
    cat = Catalog(
        sources={SOURCE: Source(name=SOURCE, kind="url", location="x", license="x", profile="p")},
        profiles={"p": FilterProfile(name="p")},
        datasets={SOURCE: Dataset(name=SOURCE, source=SOURCE, profile="p")},
        phases={},
        models={"m": Model(name="m", resolution=512, unet_config={"x": 1})},
        directory=tmp_path,
    )
    keys = sorted(token_order())
    view = pa.table({"shard": [SHARD] * len(keys), "key": keys})
    monkeypatch.setattr(views_stage, "view_key_groups", lambda root, c, d: iter([view]))
    p = phase(MixEntry(dataset=SOURCE, count=8), seed=1)
    mix.phase_set_for_run(tmp_path, cat, p)
    phase_dir = tmp_path / "phases" / "p1"
    before = [PhaseSet(phase_dir)[i][0] for i in range(8)]
    (tmp_path / "runs" / "p1" / "checkpoints" / "step-000002").mkdir(parents=True)

    redone = encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=flipped)
    assert not redone.skipped  # the source now holds the flipped spec's files
    assert {z.shape[1] for z in read_bucketed(tmp_path)[1].values()} == {2}
    assert mix.phase_set_for_run(tmp_path, cat, p)["reused"]
    data = PhaseSet(phase_dir)  # the earlier phase resumes (and evaluates) on what it mixed
    for i, latent in enumerate(before):
        assert torch.equal(data[i][0], latent)
    kept = tmp_path / SOURCE / "latents" / f"spec-{plain.digest()}"
    assert (kept / f"{SHARD}.keys.arrow").is_file()

    def prune(*flags: str) -> str:
        assert main(["--data-root", str(tmp_path), "prune-latents", *flags]) == 0
        return capsys.readouterr().out

    assert "nothing to prune" in prune("--yes") and kept.is_dir()  # still linked: kept
    shutil.rmtree(tmp_path / "runs" / "p1" / "checkpoints")  # p1 started over: mixed anew
    assert not mix.phase_set_for_run(tmp_path, cat, p)["reused"]
    listed = prune()  # a dry run by default: lists, deletes nothing
    assert f"spec-{plain.digest()}/{SHARD}.keys.arrow" in listed and "--yes" in listed
    assert kept.is_dir()
    assert "deleted" in prune("--yes") and not kept.exists()
    PhaseSet(phase_dir)  # the new set reads the current files
