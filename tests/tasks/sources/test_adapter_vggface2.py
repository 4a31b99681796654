"""VGGFace2 adapter on a generated mirror in the released layout: index, repack, tokenize."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from catalog import FilterProfile, Source, buckets
from tasks.latents.tokenize import clean_caption, tokenize_shard
from tasks.runtime.shards import summarize
from tasks.sources.adapters import adapter_for
from tasks.sources.adapters.base import SourceLayoutError, index_source, repack_shard, shard_names
from tasks.sources.adapters.vggface2 import template_index
from tests.tasks import bad_images as bad

TEMPLATES = ["a photo of a person's face", "a headshot of a person", "a close portrait"]
PROFILE = FilterProfile(name="x", min_side=64)


def displayed_halves() -> np.ndarray:
    """Top half red, bottom half blue: shows whether EXIF orientation was applied."""
    rgb = bad.canvas(128, 128, bad.BLUE)
    rgb[:64] = bad.RED
    return rgb


# path -> (bytes, reason at repack or "success"); files not in the layout: unexpected_path
IMAGES = {
    "train/n000001/0001_01.jpg": (bad.jpeg(120, 150), "success"),
    "train/n000001/0002_01.jpg": (bad.cmyk_jpeg(), "success"),
    "train/n000001/0003_01.jpg": (bad.gray_jpeg(), "success"),
    "train/n000002/0001_01.jpg": (bad.rgba_png(alpha=255), "success"),  # PNG bytes, .jpg name
    "train/n000002/0002_01.jpg": (bad.png16(), "success"),
    "train/n000002/0003_02.jpg": (bad.exif_rotated_jpeg(displayed_halves()), "success"),
    "train/n000003/0001_01.jpg": (bad.animated_gif(), "success"),
    "train/n000003/0002_01.jpg": (bad.truncated_jpeg(), "truncated"),
    "train/n000003/0003_01.jpg": (bad.not_an_image(), "decode_error"),
    "train/n000003/0004_01.jpg": (bad.tiny_jpeg(40), "too_small"),
}
UNEXPECTED = {
    "train/n000003/notes.txt": b"not an image",
    "train/n000003/0005_01.png": bad.jpeg(),
    "train/0001_01.jpg": bad.jpeg(),
    "train/n000004/extra/0001_01.jpg": bad.jpeg(),
}
IGNORED = {"meta/identity_meta.csv": b"Class_ID, Name\n", "bb_landmark/loose_bb_train.csv": b""}


@pytest.fixture
def mirror(tmp_path) -> Path:
    m = tmp_path / "mirror" / "vggface2"
    files = {p: d for p, (d, _) in IMAGES.items()} | UNEXPECTED | IGNORED
    for rel, data in files.items():
        (m / rel).parent.mkdir(parents=True, exist_ok=True)
        (m / rel).write_bytes(data)
    return m


def source(location: Path | str, **options) -> Source:
    return Source(
        name="vggface2",
        kind="folder",
        location=str(location),
        license="test",
        profile="x",
        resolution=64,
        samples_per_shard=4,
        options={"caption_templates": TEMPLATES, **options},
    )


def index(root: Path, src: Source):
    return index_source(root, src, adapter_for(src, PROFILE))


def metadata(root: Path) -> list[dict]:
    return [
        row
        for shard in shard_names(root, "vggface2")
        for row in pq.read_table(root / "vggface2" / "metadata" / f"{shard}.parquet").to_pylist()
    ]


def test_index_repack_tokenize(tmp_path, mirror):
    root = tmp_path / "data"
    src = source(mirror)
    adapter = adapter_for(src, PROFILE)

    stats = index_source(root, src, adapter)
    assert (stats.num_in, stats.num_out) == (len(IMAGES) + len(UNEXPECTED), len(IMAGES))
    assert stats.dropped == {"unexpected_path": len(UNEXPECTED)}
    rows = metadata(root)
    assert [r["origin"] for r in rows] == sorted(IMAGES)  # stable order
    for r in rows:
        assert r["identity"] == r["origin"].split("/")[1]
        assert r["caption"] == TEMPLATES[template_index(r["origin"], len(TEMPLATES))]
        assert r["crop"] is None
    assert len({r["caption"] for r in rows}) > 1  # the templates are all used
    shards = shard_names(root, "vggface2")
    assert shards == ["00000", "00001", "00002"]  # 10 rows, 4 per shard

    repacked = [repack_shard(root, src, adapter, s) for s in shards]
    for s in repacked:
        assert s.num_in == s.num_out + sum(s.dropped.values())
    total = summarize(repacked)
    want_drops = {}
    for _, reason in IMAGES.values():
        if reason != "success":
            want_drops[reason] = want_drops.get(reason, 0) + 1
    assert total["num_in"] == len(IMAGES)
    assert total["dropped"] == want_drops
    assert total["num_out"] == len(IMAGES) - sum(want_drops.values())

    status = {}
    for shard in shards:
        table = pq.read_table(root / "vggface2" / "shards" / f"{shard}.parquet").to_pylist()
        with tarfile.open(root / "vggface2" / "shards" / f"{shard}.tar") as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        kept = [r for r in table if r["status"] == "success"]
        assert sorted(members) == sorted(
            f"{r['key']}.{e}" for r in kept for e in ("jpg", "txt", "json")
        )
        for r in table:
            status[r["origin"]] = r["status"]
            assert r["identity"] == r["origin"].split("/")[1]
        for r in kept:
            px = cv2.imdecode(np.frombuffer(members[f"{r['key']}.jpg"], np.uint8), cv2.IMREAD_COLOR)
            stored_w, stored_h = buckets.stored_size(r["width"], r["height"], 64)
            assert px.shape == (stored_h, stored_w, 3)  # aspect kept, at most 64² px
            assert members[f"{r['key']}.txt"].decode() == r["caption"]
            meta = json.loads(members[f"{r['key']}.json"])
            assert meta["identity"] == r["identity"] and meta["origin"] == r["origin"]
            assert (meta["width"], meta["height"]) == (r["width"], r["height"])
            if r["origin"].endswith("0003_02.jpg"):  # EXIF-rotated: red on top as displayed
                rgb = cv2.cvtColor(px, cv2.COLOR_BGR2RGB).astype(int)
                assert np.abs(rgb[:24].mean((0, 1)) - bad.RED).max() < 20
                assert np.abs(rgb[40:].mean((0, 1)) - bad.BLUE).max() < 20
        # tokenize reads what filter-pixels selects: here, every repacked sample
        selected = root / "vggface2" / "selected" / f"{shard}.parquet"
        selected.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(success_rows(root, shard), selected)
        tok = tokenize_shard(root, "vggface2", shard)
        assert (tok.num_in, tok.num_out, tok.dropped) == (len(kept), len(kept), {})
        ids = pq.read_table(root / "vggface2" / "tokens" / f"{shard}.parquet")
        assert ids["key"].to_pylist() == [r["key"] for r in kept]
        assert all(len(x) == 77 for x in ids["input_ids"].to_pylist())
    assert status == {p: reason for p, (_, reason) in IMAGES.items()}
    assert bad.files_outside(root, mirror) == []


def success_rows(root: Path, shard: str):
    """key + caption of a shard's repacked samples, as filter-pixels writes `selected/`."""
    table = pq.read_table(root / "vggface2" / "shards" / f"{shard}.parquet")
    return table.filter(pc.equal(table["status"], "success")).select(["key", "caption"])


def test_captions_are_deterministic(tmp_path, mirror):
    index(tmp_path / "a", source(mirror))
    index(tmp_path / "b", source(mirror))
    assert metadata(tmp_path / "a") == metadata(tmp_path / "b")


def test_limits(tmp_path, mirror):
    stats = index(tmp_path / "data", source(mirror, identities_limit=2, images_per_identity=2))
    assert stats.num_out == 4
    assert stats.dropped == {
        "unexpected_path": len(UNEXPECTED),
        "images_per_identity": 2,  # n000001/0003, n000002/0003
        "identities_limit": 4,  # n000003's images
    }
    assert {r["identity"] for r in metadata(tmp_path / "data")} == {"n000001", "n000002"}


def test_blank_template_is_a_caption_drop(tmp_path, mirror):
    stats = index(tmp_path / "data", source(mirror, caption_templates=["   "]))
    _, reason = clean_caption("   ")
    assert reason and stats.num_out == 0
    assert stats.dropped == {"unexpected_path": len(UNEXPECTED), reason: len(IMAGES)}


def test_missing_folder_says_where(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(SourceLayoutError) as e:
        index(tmp_path / "data", source(missing))
    message = str(e.value)
    assert "\n" not in message and str(missing) in message
    assert "vggface2.location" in message and "sources.yaml" in message


def test_missing_split_says_which(tmp_path, mirror):
    with pytest.raises(SourceLayoutError, match=r"no train/ folder"):
        index(tmp_path / "data", source(mirror.parent))
