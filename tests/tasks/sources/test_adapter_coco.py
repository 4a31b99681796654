"""COCO adapter on generated mirrors in the images.cocodataset.org layout: index, repack, tokenize.

The person boxes are painted green on blue in the fixture images, so a repacked sample can be
compared with the square crop it should be (the EXIF-rotated one as displayed).
"""

from __future__ import annotations

import json
import tarfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import fsspec
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from catalog import FilterProfile, Source
from tasks.latents.tokenize import clean_caption, tokenize_shard
from tasks.runtime.shards import summarize
from tasks.sources.adapters import (
    SourceLayoutError,
    adapter_for,
    index_source,
    repack_shard,
    shard_names,
)
from tasks.sources.adapters.base import fetch_archive, release_archive
from tasks.sources.adapters.coco import square_crop
from tests.tasks import bad_images as bad

PROFILE = FilterProfile(name="x", min_side=64)
MARGIN = 0.1
SURROGATE = "a man \udcff on a bike"  # what a JSON escape can hold and UTF-8 cannot


def painted(width: int, height: int, *boxes: tuple[tuple, tuple]) -> np.ndarray:
    rgb = bad.canvas(width, height, bad.BLUE)
    for (x, y, w, h), color in boxes:
        rgb[y : y + h, x : x + w] = color
    return rgb


def person(image_id: int, box, ann_id: int | None = None, **kw) -> dict:
    return {
        "id": ann_id or image_id * 10,
        "image_id": image_id,
        "category_id": 1,
        "iscrowd": 0,
        "bbox": [float(v) for v in box],
        **kw,
    }


TALL = (130, 10, 60, 100)  # off-center: the square is shifted to stay inside the image
LEFT, SHORT = (20, 10, 50, 100), (140, 40, 40, 70)
EXIF_BOX = (30, 40, 60, 150)  # in the displayed (portrait) frame
SQUARE = (14, 14, 100, 100)  # in the 128 x 128 test images


def coco_fixture() -> tuple[dict, dict, dict[int, str], dict[int, np.ndarray]]:
    """(instances, captions, zip members by file name, displayed pixels of the checked images),
    and each image's expected outcome in `EXPECTED`."""
    images, persons, captions, members, shown = [], [], [], {}, {}

    def add(image_id, data, width, height, *, name=None, boxes=(), caps=("a person",)):
        name = name or f"{image_id:012d}.jpg"
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        if data is not None:
            members[name] = data
        persons.extend(boxes)
        for i, c in enumerate(caps):
            captions.append({"id": image_id * 10 + i, "image_id": image_id, "caption": c})

    shown[1] = painted(200, 120, (TALL, bad.GREEN))
    add(1, bad.jpeg_of(shown[1]), 200, 120, boxes=[person(1, TALL)], caps=())
    # its captions out of id order, the second one not UTF-8-encodable: the first by id wins
    captions += [
        {"id": 17, "image_id": 1, "caption": "the second caption"},
        {"id": 12, "image_id": 1, "caption": SURROGATE},
        {"id": 3, "image_id": 1, "caption": "a skier standing on a slope"},
    ]
    shown[2] = painted(200, 120, (LEFT, bad.GREEN), (SHORT, bad.RED))
    add(2, bad.jpeg_of(shown[2]), 200, 120, boxes=[person(2, SHORT, 21), person(2, LEFT, 22)])
    shown[3] = painted(120, 200, (EXIF_BOX, bad.GREEN))
    add(3, bad.exif_rotated_jpeg(shown[3]), 120, 200, boxes=[person(3, EXIF_BOX)])
    for image_id, data in (
        (4, bad.cmyk_jpeg()),
        (5, bad.gray_jpeg()),
        (6, bad.rgba_png(alpha=128)),
        (7, bad.png16()),
        (8, bad.animated_gif()),
        (9, bad.truncated_jpeg()),
        (10, bad.not_an_image()),
        (12, bad.jpeg()),  # its zip member is corrupted below
        (13, None),  # listed, not in the zip
    ):
        add(image_id, data, 128, 128, boxes=[person(image_id, SQUARE)])
    add(11, bad.tiny_jpeg(40), 40, 40, boxes=[person(11, (5, 5, 30, 30))])
    add(14, bad.jpeg(), 128, 128, boxes=[person(14, (10, 10, 40, 60))])  # 60 < 0.55 * 128
    crowd = person(15, SQUARE, iscrowd=1)
    dog = {**person(15, SQUARE, 151), "category_id": 18}
    add(15, bad.jpeg(), 128, 128, boxes=[crowd, dog])
    add(16, bad.jpeg(), 128, 128, boxes=[person(16, SQUARE)], caps=())
    add(17, bad.jpeg(), 128, 128, boxes=[person(17, SQUARE)], caps=(bad.EMPTY_CAPTION,))
    add(18, bad.jpeg(), 128, 128, boxes=[person(18, SQUARE)], caps=(bad.WHITESPACE_CAPTION,))
    add(19, bad.jpeg(), 128, 128, boxes=[person(19, SQUARE)], caps=(SURROGATE,))
    add(20, None, 128, 128, name="../../evil.jpg", boxes=[person(20, SQUARE)])
    add(21, None, 128, 128, name="/tmp/evil.jpg", boxes=[person(21, SQUARE)])
    add(22, bad.jpeg(), None, 128, boxes=[person(22, SQUARE)])  # no width
    persons.append(person(999, SQUARE, 9990))  # orphan rows: image 999 is not listed
    captions.append({"id": 9991, "image_id": 999, "caption": "an orphan"})
    members["../evil.jpg"] = bad.jpeg()  # unsafe names in the zip itself are never read

    categories = [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}]
    instances = {"images": images, "annotations": persons, "categories": categories}
    return instances, {"images": images, "annotations": captions}, members, shown


def reason(caption) -> str:
    return clean_caption(caption)[1]


# image id -> where it ends: an index reason, a repack reason, or "success"
EXPECTED = {
    **dict.fromkeys((1, 2, 3, 4, 5, 6, 7, 8), "success"),
    9: "truncated",
    10: "decode_error",
    11: "too_small",
    12: "truncated_archive",
    13: "missing_image",
    14: "person_too_short",
    15: "no_person",
    16: "missing_caption",
    17: "caption:empty",
    18: "caption:whitespace",
    19: "caption:surrogate",
    20: "unsafe_path",
    21: "unsafe_path",
    22: "bad_annotation",
}
INDEX_REASONS = {
    "person_too_short",
    "no_person",
    "missing_caption",
    "unsafe_path",
    "bad_annotation",
}
ORPHANS = 2


def expected_reason(outcome: str) -> str:
    captions = {
        "caption:empty": bad.EMPTY_CAPTION,
        "caption:whitespace": bad.WHITESPACE_CAPTION,
        "caption:surrogate": SURROGATE,
    }
    return reason(captions[outcome]) if outcome in captions else outcome


def write_mirror(
    fs, base: str, scratch: Path, *, loose_annotations: bool = False, loose_images: bool = False
) -> None:
    """The fixture in the upstream layout under `base`, or with the annotation JSON and/or the
    images loose (the loose images leave out the zip's unsafe names and its damage)."""
    instances, captions, members, _ = coco_fixture()
    images = {f"train2017/{n}": d for n, d in members.items()}
    if loose_images:
        files = {name: data for name, data in images.items() if not bad_name(name)}
    else:
        images_zip = bad.write_zip(scratch / "train2017.zip", images)
        bad.corrupt_zip_member(images_zip, "train2017/000000000012.jpg")
        files = {"zips/train2017.zip": images_zip.read_bytes()}
    jsons = {
        "annotations/instances_train2017.json": json.dumps(instances).encode(),
        "annotations/captions_train2017.json": json.dumps(captions).encode(),
    }
    if loose_annotations:
        files |= jsons
    else:
        ann_zip = bad.write_zip(scratch / "annotations_trainval2017.zip", jsons)
        files["annotations/annotations_trainval2017.zip"] = ann_zip.read_bytes()
    for rel, data in files.items():
        fs.makedirs(f"{base}/{rel.rpartition('/')[0]}", exist_ok=True)
        with fs.open(f"{base}/{rel}", "wb") as f:
            f.write(data)


def bad_name(name: str) -> bool:
    return ".." in name.split("/") or "//" in name


def source(location: str, **options) -> Source:
    return Source(
        name="coco",
        kind="archive",
        location=location,
        license="test",
        profile="x",
        resolution=64,
        samples_per_shard=8,
        options={"person_min_height": 0.55, "crop_margin": MARGIN, **options},
    )


@pytest.fixture
def remote(tmp_path):
    """A mirror on fsspec's in-memory filesystem: read as a remote one (archives copied)."""
    fs = fsspec.filesystem("memory")
    base = f"/coco-{uuid.uuid4().hex}"
    write_mirror(fs, base, tmp_path)
    yield f"memory://{base}"
    fs.rm(base, recursive=True)


def local_mirror(tmp_path: Path, **kw) -> Path:
    mirror = tmp_path / "mirror"
    (tmp_path / "scratch").mkdir()
    write_mirror(fsspec.filesystem("file"), str(mirror), tmp_path / "scratch", **kw)
    return mirror


def read_all(root: Path, stage: str) -> list[dict]:
    return [
        row
        for shard in shard_names(root, "coco")
        for row in pq.read_table(root / "coco" / stage / f"{shard}.parquet").to_pylist()
    ]


def test_index_repack_tokenize(tmp_path, remote):
    root = tmp_path / "data"
    src = source(remote)
    adapter = adapter_for(src, PROFILE)
    _, _, _, shown = coco_fixture()

    stats = index_source(root, src, adapter)
    want = {}
    for outcome in EXPECTED.values():
        if expected_reason(outcome) in INDEX_REASONS or outcome.startswith("caption:"):
            want[expected_reason(outcome)] = want.get(expected_reason(outcome), 0) + 1
    want["orphan_annotation"] = ORPHANS
    indexed = [i for i, o in EXPECTED.items() if expected_reason(o) not in want]
    assert stats.dropped == want
    assert (stats.num_in, stats.num_out) == (len(EXPECTED) + ORPHANS, len(indexed))
    rows = read_all(root, "metadata")
    assert [r["coco_id"] for r in rows] == indexed  # in image id order
    assert shard_names(root, "coco") == ["00000", "00001"]
    first = rows[0]
    assert first["origin"] == "zips/train2017.zip::train2017/000000000001.jpg"
    assert first["caption"] == "a skier standing on a slope"  # the first by annotation id
    assert first["captions"] == ["a skier standing on a slope", None, "the second caption"]
    assert first["num_captions"] == 3 and first["person_box"] == list(TALL)
    assert first["crop"] == [90, 5, 110, 110]  # side 1.1 * 100, shifted left to fit
    assert rows[1]["person_box"] == list(LEFT)  # the tallest of two qualifying persons

    # two shards at once, as the flow's thread runner does: one archive copy, shared
    with ThreadPoolExecutor(2) as pool:
        repacked = list(
            pool.map(lambda s: repack_shard(root, src, adapter, s), shard_names(root, "coco"))
        )
    for s in repacked:
        assert s.num_in == s.num_out + sum(s.dropped.values())
    total = summarize(repacked)
    want = {}
    for i in indexed:
        if EXPECTED[i] != "success":
            want[EXPECTED[i]] = want.get(EXPECTED[i], 0) + 1
    assert total["num_in"] == len(indexed) and total["dropped"] == want
    table = read_all(root, "shards")
    assert {r["coco_id"]: r["status"] for r in table} == {i: EXPECTED[i] for i in indexed}
    assert not (root / "coco" / "raw" / "zips" / "train2017.zip").exists()  # copy removed

    for shard in shard_names(root, "coco"):
        with tarfile.open(root / "coco" / "shards" / f"{shard}.tar") as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        rows = pq.read_table(root / "coco" / "shards" / f"{shard}.parquet")
        kept = rows.filter(pc.equal(rows["status"], "success"))
        names = [f"{k}.{e}" for k in kept["key"].to_pylist() for e in ("jpg", "txt", "json")]
        assert sorted(members) == sorted(names)
        for r in kept.to_pylist():
            bgr = cv2.imdecode(np.frombuffer(members[f"{r['key']}.jpg"], np.uint8), 1)
            assert bgr.shape == (64, 64, 3)
            meta = json.loads(members[f"{r['key']}.json"])
            assert meta["coco_id"] == r["coco_id"] and meta["person_box"] == r["person_box"]
            assert members[f"{r['key']}.txt"].decode() == r["caption"]
            if r["coco_id"] in shown:  # the square around the person, as displayed
                img = shown[r["coco_id"]]
                x, y, side, _ = square_crop(r["person_box"], img.shape[1], img.shape[0], MARGIN)
                # Where the square leaves the image it is padded with mid-gray.
                pad = [max(0, -y), max(0, y + side - img.shape[0])]
                pad += [max(0, -x), max(0, x + side - img.shape[1])]
                framed = cv2.copyMakeBorder(img, *pad, cv2.BORDER_CONSTANT, value=(127,) * 3)
                x0, y0 = x + pad[2], y + pad[0]
                want_px = cv2.resize(
                    framed[y0 : y0 + side, x0 : x0 + side], (64, 64), cv2.INTER_AREA
                )
                got = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
                assert np.abs(got.astype(int) - want_px).mean() < 8, r["coco_id"]
                assert np.abs(got[32, 32].astype(int) - bad.GREEN).max() < 30
                assert (r["width"], r["height"]) == (img.shape[1], img.shape[0])
                if r["coco_id"] == 3:  # portrait, the person taller than the image is wide
                    green = np.all(np.abs(got.astype(int) - bad.GREEN) < 40, axis=2)
                    rows_green = np.flatnonzero(green.any(axis=1))
                    assert rows_green[0] <= 4 and rows_green[-1] >= 59  # head and feet kept
                    assert np.abs(got[32, :6].astype(int) - 127).max() < 12  # gray pad
        selected = root / "coco" / "selected" / f"{shard}.parquet"
        selected.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(kept.select(["key", "caption"]), selected)
        tok = tokenize_shard(root, "coco", shard)
        assert (tok.num_in, tok.num_out, tok.dropped) == (kept.num_rows, kept.num_rows, {})
        ids = pq.read_table(root / "coco" / "tokens" / f"{shard}.parquet")
        assert ids["key"].to_pylist() == kept["key"].to_pylist()
        assert all(len(x) == 77 for x in ids["input_ids"].to_pylist())
        # Every caption of an image reaches the tokens file, for train-time captions.
        assert ids["captions"].to_pylist() == [
            [c.strip() for c in cs if c and c.strip()] for cs in kept["captions"].to_pylist()
        ]
        assert ids["caption"].to_pylist() == [cs[0] for cs in ids["captions"].to_pylist()]
    assert (
        bad.files_outside(
            root, tmp_path / "train2017.zip", tmp_path / "annotations_trainval2017.zip"
        )
        == []
    )


def test_archive_copy_removed_by_its_last_user(tmp_path, remote):
    adapter = adapter_for(source(remote), PROFILE)
    first, copied = fetch_archive(tmp_path, adapter, "zips/train2017.zip")
    second, _ = fetch_archive(tmp_path, adapter, "zips/train2017.zip")
    assert copied and first == second == tmp_path / "coco" / "raw" / "zips" / "train2017.zip"
    release_archive(first, remove=True)
    assert second.is_file()  # another shard still reads it
    release_archive(second, remove=True)
    assert not second.exists()


def test_loose_annotations_index_the_same(tmp_path, remote):
    index_source(tmp_path / "a", source(remote), adapter_for(source(remote), PROFILE))
    mirror = local_mirror(tmp_path, loose_annotations=True)
    assert (mirror / "annotations" / "captions_train2017.json").is_file()
    index_source(tmp_path / "b", source(str(mirror)), adapter_for(source(str(mirror)), PROFILE))
    assert read_all(tmp_path / "a", "metadata") == read_all(tmp_path / "b", "metadata")


def test_loose_images_folder(tmp_path):
    mirror = local_mirror(tmp_path, loose_annotations=True, loose_images=True)
    assert not (mirror / "zips").exists() and (mirror / "train2017").is_dir()
    root, src = tmp_path / "data", source(str(mirror))
    adapter = adapter_for(src, PROFILE)
    index_source(root, src, adapter)
    rows = read_all(root, "metadata")
    assert rows[0]["origin"] == "train2017/000000000001.jpg"
    for shard in shard_names(root, "coco"):
        repack_shard(root, src, adapter, shard)
    status = {r["coco_id"]: r["status"] for r in read_all(root, "shards")}
    want = {r["coco_id"]: EXPECTED[r["coco_id"]] for r in rows} | {12: "success"}  # not damaged
    assert status == want
    assert bad.files_outside(root, mirror, tmp_path / "scratch") == []


@pytest.mark.parametrize(
    ("width", "height", "box", "crop"),
    [
        (640, 480, (300, 40, 80, 400), (120, 20, 440, 440)),  # centered, 1.1 x the box
        (640, 480, (0, 0, 100, 470), (0, -24, 517, 517)),  # taller than the image: padded
        (300, 500, (100, 20, 100, 460), (-103, -3, 506, 506)),  # portrait: padded both ways
        (640, 480, (600, 100, 40, 300), (310, 85, 330, 330)),  # shifted inside on the right
        (300, 500, (10, 300, 200, 190), (0, 280, 220, 220)),  # wide box, shifted up and right
    ],
)
def test_square_crop(width, height, box, crop):
    assert square_crop(box, width, height, MARGIN) == crop


def test_missing_annotations_say_what(tmp_path):
    mirror = tmp_path / "mirror"
    bad.write_zip(mirror / "zips" / "train2017.zip", {"train2017/000000000001.jpg": bad.jpeg()})
    src = source(str(mirror))
    with pytest.raises(SourceLayoutError) as e:
        index_source(tmp_path / "data", src, adapter_for(src, PROFILE))
    message = str(e.value)
    assert "\n" not in message and "annotations/instances_train2017.json" in message
    assert "annotations_trainval2017.zip" in message and str(mirror) in message


def test_missing_images_say_what(tmp_path):
    src = source(str(tmp_path / "nowhere"))
    with pytest.raises(SourceLayoutError, match=r"zips/train2017.zip.*sources.yaml"):
        index_source(tmp_path / "data", src, adapter_for(src, PROFILE))
