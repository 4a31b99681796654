"""DiffusionDB adapter on a tiny mirror laid out like poloclub/diffusiondb: metadata.parquet +
images/part-NNNNNN.zip (images + part-NNNNNN.json), through index -> repack -> tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.sources.adapters import SourceLayoutError, adapter_for
from tasks.sources.adapters.base import index_source
from tests.tasks import bad_images as bad
from tests.tasks.fixtures_archives import (
    PROFILE,
    check_shards,
    close,
    served_chain,
    source,
)

GREY = (128, 128, 128)


def exif_displayed() -> np.ndarray:
    """160 x 96 as displayed: left half red, right half blue."""
    img = bad.canvas(160, 96, bad.RED)
    img[:, 80:] = bad.BLUE
    return img


# part -> [(image name, bytes or None: listed in the metadata, absent from the zip,
#           metadata prompt (None: null, read from the part JSON), part-JSON prompt)]
PARTS = {
    1: [
        ("a1.png", bad.encode(bad.canvas(128, 96, bad.GREEN), "PNG"), "a green field", "x"),
        ("rgba.png", bad.rgba_png(96, 96), "a transparent square", "x"),
        ("deep.png", bad.png16(112, 96), "a sixteen bit red square", "x"),
        ("html.png", bad.not_an_image(), "not an image at all", "x"),
        ("tiny.png", bad.tiny_jpeg(16), "a tiny picture", "x"),
        ("cut.png", bad.rgba_png(128, 128, alpha=255), "a damaged member", "x"),
        ("gone.png", None, "listed but not in the zip", "x"),
        ("fallback.png", bad.jpeg(96, 96, bad.BLUE), None, "a prompt from the part json"),
        ("badutf8.png", bad.jpeg(96, 96), None, bad.INVALID_UTF8_CAPTION),
        ("empty.png", bad.jpeg(96, 96), bad.EMPTY_CAPTION, "x"),
        ("blank.png", bad.jpeg(96, 96), bad.WHITESPACE_CAPTION, "x"),
        ("../escape.png", bad.jpeg(96, 96), "a member outside its folder", "x"),
        ("/abs.png", bad.jpeg(96, 96), "an absolute member", "x"),
    ],
    2: [
        ("cmyk.png", bad.cmyk_jpeg(96, 96), "a cmyk red square", "x"),
        ("gray.png", bad.gray_jpeg(96, 128), "a grey square", "x"),
        ("turned.png", bad.exif_rotated_jpeg(exif_displayed()), "red left, blue right", "x"),
        ("anim.png", bad.animated_gif(100, 100), "an animated gif", "x"),
    ],
    3: [("unchosen.png", bad.jpeg(96, 96), "a part that is not chosen", "x")],
}

INDEX_DROPS = {"empty_caption": 2, "caption_encoding": 1, "unsafe_path": 2}
REPACK_DROPS = {"decode_error": 1, "too_small": 1, "truncated_archive": 1, "missing_image": 1}
NUM_CHOSEN = len(PARTS[1]) + len(PARTS[2])


def write_mirror(folder: Path, *, drop_columns: tuple[str, ...] = ()) -> Path:
    rows = []
    for part, images in PARTS.items():
        members, part_meta = {}, {}
        for i, (name, data, prompt, json_prompt) in enumerate(images):
            if data is not None:
                members[name] = data
            p = json_prompt.decode("latin-1") if isinstance(json_prompt, bytes) else json_prompt
            part_meta[name] = {"p": p, "se": i, "c": 7.0, "st": 50, "sa": "k_lms"}
            rows.append(
                {
                    "image_name": name,
                    "prompt": prompt,
                    "part_id": part,
                    "seed": 1000 + i,
                    "step": 50,
                    "cfg": 7.0,
                    "sampler": "k_lms",
                    "width": 512,
                    "height": 512,
                    "user_name": "hashed-user",
                    "timestamp": None,
                    "image_nsfw": 0.1 * part,
                    "prompt_nsfw": 0.01 * i,
                }
            )
        raw_json = json.dumps(part_meta, ensure_ascii=False).encode()
        # the invalid UTF-8 prompt as raw bytes in the JSON file, as a broken upstream would be
        raw_json = raw_json.replace(
            bad.INVALID_UTF8_CAPTION.decode("latin-1").encode(), bad.INVALID_UTF8_CAPTION
        )
        members[f"part-{part:06d}.json"] = raw_json
        zip_path = bad.write_zip(folder / "images" / f"part-{part:06d}.zip", members)
        if part == 1:
            bad.corrupt_zip_member(zip_path, "cut.png")
    schema = pa.schema(
        [
            ("image_name", pa.string()),
            ("prompt", pa.string()),
            ("part_id", pa.uint16()),
            ("seed", pa.uint32()),
            ("step", pa.uint16()),
            ("cfg", pa.float32()),
            ("sampler", pa.string()),
            ("width", pa.uint16()),
            ("height", pa.uint16()),
            ("user_name", pa.string()),
            ("timestamp", pa.timestamp("s", tz="UTC")),
            ("image_nsfw", pa.float32()),
            ("prompt_nsfw", pa.float32()),
        ]
    )
    table = pa.Table.from_pylist(rows, schema).drop_columns(list(drop_columns))
    pq.write_table(table, folder / "metadata.parquet")
    return folder


@pytest.mark.parametrize("served", ["local", "http"])
def test_diffusiondb_index_repack_tokens(tmp_path, served):
    mirror = write_mirror(tmp_path / "mirror")
    root = tmp_path / "data"
    chain = served_chain(root, mirror, served, "diffusiondb", per_shard=5, parts=2)

    # index: the rows of parts 1 and 2, caption and path faults counted
    assert chain.index.num_in == NUM_CHOSEN
    assert dict(chain.dropped("metadata")) == INDEX_DROPS
    indexed = NUM_CHOSEN - sum(INDEX_DROPS.values())
    assert chain.index.num_out == indexed == len(chain.rows)
    assert chain.index.extra["num_shards"] == len(chain.repack) == -(-indexed // 5)
    # repack: image faults counted, the awkward-but-valid images kept
    assert sum(s.num_in for s in chain.repack) == indexed
    assert dict(chain.dropped("shards")) == REPACK_DROPS
    kept = indexed - sum(REPACK_DROPS.values())
    assert sum(s.num_out for s in chain.repack) == kept == len(chain.success())
    by_name = {r["origin"].split("::")[1]: r for r in chain.rows}
    assert {n: by_name[n]["status"] for n in ("html.png", "tiny.png", "cut.png", "gone.png")} == {
        "html.png": "decode_error",
        "tiny.png": "too_small",
        "cut.png": "truncated_archive",
        "gone.png": "missing_image",
    }
    assert not any("unchosen" in r["origin"] for r in chain.rows)
    # tokens: every kept caption tokenized
    assert sum(s.num_in for s in chain.tokens) == kept
    assert sum(s.num_out for s in chain.tokens) == kept and not chain.dropped("tokens")

    pixels = check_shards(root, chain, "diffusiondb")
    px = {name: pixels[r["key"]] for name, r in by_name.items() if r["key"] in pixels}
    assert close(px["rgba.png"], bad.WHITE)  # transparent: over white
    assert close(px["deep.png"], bad.RED)  # 16-bit: the high byte
    assert close(px["cmyk.png"], bad.RED, tol=40)
    assert close(px["gray.png"], GREY)
    assert close(px["anim.png"], bad.RED)  # the first frame
    assert (by_name["turned.png"]["width"], by_name["turned.png"]["height"]) == (160, 96)
    assert close(px["turned.png"][:, :20], bad.RED, tol=40)
    assert close(px["turned.png"][:, -20:], bad.BLUE, tol=40)
    # captions: metadata prompt, else the part JSON's
    assert by_name["fallback.png"]["caption"] == "a prompt from the part json"
    assert by_name["a1.png"]["caption"] == "a green field"
    # source extras kept, typed
    r = by_name["turned.png"]
    assert r["image_nsfw"] == pytest.approx(0.2) and r["prompt_nsfw"] == pytest.approx(0.02)
    assert (r["part_id"], r["seed"], r["step"], r["sampler"]) == (2, 1002, 50, "k_lms")
    assert r["cfg"] == pytest.approx(7.0)
    table = pq.read_table(root / "diffusiondb" / "shards" / "00000.parquet")
    assert table.schema.field("image_nsfw").type == pa.float64()
    assert {"image_nsfw", "prompt_nsfw"} <= set(table.column_names)
    # nothing outside the data root; remote copies under raw/ removed after use
    assert bad.files_outside(root, mirror) == []
    assert not list((root / "diffusiondb").glob("raw/**/*.zip"))


def test_diffusiondb_parts_as_list(tmp_path):
    mirror = write_mirror(tmp_path / "mirror")
    src = source("diffusiondb", str(mirror), parts=[3, 2])
    entries = list(adapter_for(src, PROFILE).entries())
    assert [e.origin for e in entries] == [
        "images/part-000003.zip::unchosen.png",
        *(f"images/part-000002.zip::{name}" for name, *_ in PARTS[2]),
    ]
    with pytest.raises(SourceLayoutError, match=r"parts \[9\] are not in"):
        list(adapter_for(source("diffusiondb", str(mirror), parts=[9]), PROFILE).entries())


def test_diffusiondb_metadata_missing_columns(tmp_path):
    mirror = write_mirror(tmp_path / "mirror", drop_columns=("image_nsfw", "prompt_nsfw"))
    src = source("diffusiondb", str(mirror), parts=1)
    with pytest.raises(SourceLayoutError) as e:
        index_source(tmp_path / "data", src, adapter_for(src, PROFILE))
    message = str(e.value)
    assert "\n" not in message
    assert "lacks column(s) image_nsfw, prompt_nsfw" in message
    assert "found: image_name, prompt, part_id" in message


def test_diffusiondb_missing_metadata(tmp_path):
    (tmp_path / "mirror").mkdir()
    src = source("diffusiondb", str(tmp_path / "mirror"))
    with pytest.raises(SourceLayoutError, match="metadata.parquet not found under"):
        list(adapter_for(src, PROFILE).entries())
