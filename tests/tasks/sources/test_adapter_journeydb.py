"""JourneyDB adapter on a tiny mirror laid out like JourneyDB/JourneyDB's train split:
data/train/train_anno_realease_repath.jsonl.tgz + data/train/imgs/NNN.tgz, through
index -> repack -> tokens."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tasks.sources.adapters import SourceLayoutError, adapter_for
from tasks.sources.adapters.journeydb import ANNOTATION, IMAGES
from tests.tasks import bad_images as bad
from tests.tasks.fixtures_archives import (
    PROFILE,
    check_shards,
    close,
    served_chain,
    source,
)


def exif_displayed() -> np.ndarray:
    """96 x 144 as displayed: top half red, bottom half blue."""
    img = bad.canvas(96, 144, bad.RED)
    img[72:] = bad.BLUE
    return img


# archive -> [(id, image bytes or None: in the annotation, not in the archive)]
ARCHIVES = {
    "000": [
        ("plain", bad.jpeg(128, 96, bad.GREEN)),
        ("cmyk", bad.cmyk_jpeg(96, 96)),
        ("gray", bad.gray_jpeg(96, 96)),
        ("turned", bad.exif_rotated_jpeg(exif_displayed())),
        ("anim", bad.animated_gif(96, 96)),
        ("alpha", bad.rgba_png(96, 96)),
        ("deep", bad.png16(96, 96)),
        ("html", bad.not_an_image()),
        ("tiny", bad.tiny_jpeg(16)),
        ("gone", None),
        ("nocap", bad.jpeg(96, 96)),
        ("empty", bad.jpeg(96, 96)),
        ("blank", bad.jpeg(96, 96)),
        ("badutf8", bad.jpeg(96, 96)),
    ],
    # cut off in transfer: the first member survives, the second is lost in the cut
    "001": [("early", bad.jpeg(96, 96, bad.BLUE)), ("late", None)],
    "002": [("unchosen", bad.jpeg(96, 96))],
}


def annotation_lines() -> list[bytes]:
    lines = []
    for archive, images in ARCHIVES.items():
        for image_id, _ in images:
            row = {
                "img_path": f"./{archive}/{image_id}.jpg",
                "prompt": f"a {image_id} picture --ar 3:2 --v 5",
                "Task1": {"Style": ["photo"], "Content": [image_id]},
                "Task2": {"Caption": f"a picture of {image_id}", "Question": [], "Answer": []},
            }
            if image_id == "nocap":
                del row["Task2"]["Caption"]
            if image_id in ("empty", "blank", "badutf8"):
                row["Task2"]["Caption"] = {"empty": "", "blank": " \t\n  "}.get(image_id, "@BAD@")
            lines.append(json.dumps(row).encode().replace(b"@BAD@", bad.INVALID_UTF8_CAPTION))
    lines += [
        b'{"img_path": "./000/broken.jpg", "prompt": "a line cut off',  # malformed
        b"[1, 2, 3]",  # JSON, but not an object
        b'{"prompt": "a row with no image"}',
        json.dumps({"img_path": "./000/../../escape.jpg", "Task2": {"Caption": "up"}}).encode(),
        json.dumps({"img_path": "/etc/passwd.jpg", "Task2": {"Caption": "absolute"}}).encode(),
    ]
    return lines


INDEX_DROPS = {
    "bad_metadata": 3,
    "unsafe_path": 2,
    "empty_caption": 3,  # no caption field, "", whitespace
    "caption_encoding": 1,
}
REPACK_DROPS = {"decode_error": 1, "too_small": 1, "missing_image": 1, "truncated_archive": 1}
NUM_CHOSEN = len(ARCHIVES["000"]) + len(ARCHIVES["001"]) + 5  # + the 5 faulty lines


def write_mirror(folder: Path) -> Path:
    imgs = folder / IMAGES
    for archive, images in ARCHIVES.items():
        members = {f"{archive}/{i}.jpg": d for i, d in images if d is not None}
        if archive == "000":
            members["../outside.jpg"] = bad.jpeg(96, 96)  # never extracted anywhere
        if archive == "001":  # the member lost in the cut: large and incompressible
            noise = np.random.default_rng(1).integers(0, 256, (160, 160, 3), dtype=np.uint8)
            members["001/late.jpg"] = bad.encode(noise, "PNG")
        bad.write_tar(imgs / f"{archive}.tgz", members, compression="gz")
    bad.truncate_file(imgs / "001.tgz", 0.6)
    buf = io.BytesIO()
    jsonl = b"\n".join(annotation_lines()) + b"\n"
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("train_anno_realease_repath.jsonl")
        info.size = len(jsonl)
        tar.addfile(info, io.BytesIO(jsonl))
    (folder / ANNOTATION).parent.mkdir(parents=True, exist_ok=True)
    (folder / ANNOTATION).write_bytes(buf.getvalue())
    return folder


@pytest.mark.parametrize("served", ["local", "http"])
def test_journeydb_index_repack_tokens(tmp_path, served):
    mirror = write_mirror(tmp_path / "mirror")
    root = tmp_path / "data"
    chain = served_chain(
        root, mirror, served, "journeydb", per_shard=6, archives=2, caption_field="Task2.Caption"
    )

    assert chain.index.num_in == NUM_CHOSEN
    assert dict(chain.dropped("metadata")) == INDEX_DROPS
    indexed = NUM_CHOSEN - sum(INDEX_DROPS.values())
    assert chain.index.num_out == indexed == len(chain.rows)
    assert sum(s.num_in for s in chain.repack) == indexed
    assert dict(chain.dropped("shards")) == REPACK_DROPS
    kept = indexed - sum(REPACK_DROPS.values())
    assert sum(s.num_out for s in chain.repack) == kept == len(chain.success())
    assert sum(s.num_in for s in chain.tokens) == kept
    assert sum(s.num_out for s in chain.tokens) == kept and not chain.dropped("tokens")

    by_id = {r["origin"].rsplit("/", 1)[1].removesuffix(".jpg"): r for r in chain.rows}
    assert by_id["plain"]["origin"] == f"{IMAGES}/000.tgz::000/plain.jpg"
    assert {i: by_id[i]["status"] for i in ("html", "tiny", "gone", "late", "early")} == {
        "html": "decode_error",
        "tiny": "too_small",
        "gone": "missing_image",
        "late": "truncated_archive",
        "early": "success",
    }
    assert "unchosen" not in by_id
    assert by_id["plain"]["caption"] == "a picture of plain"  # the chosen caption field

    pixels = check_shards(root, chain, "journeydb")
    px = {i: pixels[r["key"]] for i, r in by_id.items() if r["key"] in pixels}
    assert close(px["cmyk"], bad.RED, tol=40)
    assert close(px["gray"], (128, 128, 128))
    assert close(px["anim"], bad.RED)
    assert close(px["alpha"], bad.WHITE)
    assert close(px["deep"], bad.RED)
    assert (by_id["turned"]["width"], by_id["turned"]["height"]) == (96, 144)
    assert close(px["turned"][:20], bad.RED, tol=40)
    assert close(px["turned"][-20:], bad.BLUE, tol=40)
    assert bad.files_outside(root, mirror) == []
    assert not list((root / "journeydb").glob("raw/**/*.tgz"))


def test_journeydb_options(tmp_path):
    mirror = write_mirror(tmp_path / "mirror")

    def origins(**options) -> list[str]:
        src = source("journeydb", str(mirror), **options)
        return [e.origin for e in adapter_for(src, PROFILE).entries() if hasattr(e, "caption")]

    # default: every archive the annotation names, captions from `prompt`
    src = source("journeydb", str(mirror))
    entries = [e for e in adapter_for(src, PROFILE).entries() if hasattr(e, "caption")]
    assert entries[0].caption == "a plain picture --ar 3:2 --v 5"
    assert len(entries) == sum(len(v) for v in ARCHIVES.values())
    assert origins(archives=["002"]) == [f"{IMAGES}/002.tgz::002/unchosen.jpg"]
    assert origins(archives=[2]) == origins(archives=["002.tgz"])
    with pytest.raises(SourceLayoutError, match="007.tgz not found under"):
        origins(archives=[7])
    with pytest.raises(SourceLayoutError, match="option archives must be"):
        origins(archives="all")


def test_journeydb_missing_annotation(tmp_path):
    (tmp_path / "mirror").mkdir()
    src = source("journeydb", str(tmp_path / "mirror"))
    with pytest.raises(SourceLayoutError, match="train_anno_realease_repath.jsonl.tgz not found"):
        list(adapter_for(src, PROFILE).entries())
