"""The local-folder adapter over a generated folder: .txt captions and seed-002 JSON tags."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from PIL import Image

from catalog import FilterProfile, Source
from sdtrain.models import tokenize
from tasks.latents import tokenize as tokens
from tasks.sources.adapters import SourceLayoutError, adapter_for, index_source, repack_shard
from tasks.sources.metadata import check_source
from tasks.sources.table import SourceError
from tests.tasks import bad_images as bad
from tests.tasks.fixtures_archives import members, read_dir

PROFILE = FilterProfile(
    name="tags",
    min_side=32,
    exclude_tags=("animated",),
    remove_tags=("high res",),
    tag_replacements={"princess luna": "luna", "artist:": "by=", " ": "_"},
    tag_separator=" ",
    min_score=200,
)


def source(location, **kw) -> Source:
    defaults = dict(kind="folder", adapter="local", license="test", profile="tags", resolution=64)
    return Source(name="mine", location=str(location), **(defaults | kw))


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "images"
    files = {
        "a/cat.jpg": bad.jpeg(120, 90),
        "a/cat.txt": b"  a cat on a mat \n",
        "a/dog.png": bad.rgba_png(100, 100, alpha=0),  # transparent: composited over white
        "a/dog.txt": "a dog, caf\u00e9 \U0001f436".encode(),
        "b/gray.jpg": bad.gray_jpeg(),
        "b/gray.txt": bad.WHITESPACE_CAPTION.encode(),  # empty_caption
        "b/latin1.jpg": bad.jpeg(),
        "b/latin1.txt": bad.INVALID_UTF8_CAPTION,  # caption_encoding
        "b/nocaption.jpg": bad.jpeg(),  # missing_caption
        "c/cut.jpg": bad.truncated_jpeg(),  # truncated (repack)
        "c/cut.txt": b"cut",
        "c/small.jpg": bad.tiny_jpeg(16),  # too_small (repack)
        "c/small.txt": b"small",
        "c/anim.gif": bad.animated_gif(),  # first frame (red)
        "c/anim.txt": b"anim",
        "c/deep.png": bad.png16(),
        "c/deep.txt": b"deep",
        "t/one.jpg": bad.jpeg(),
        "t/one.json": json.dumps(
            {"tags": ["solo", "high res", "princess luna", "artist:some one"], "score": 300}
        ).encode(),
        "t/two.jpg": bad.jpeg(),
        "meta/two.json": json.dumps(
            {"path": "t/two.jpg", "tags": ["animated"], "score": 900}
        ).encode(),
        "t/three.jpg": bad.jpeg(),
        "t/three.json": json.dumps({"tags": ["solo"], "score": 10}).encode(),  # min_score
        "meta/ghost.json": json.dumps({"path": "t/ghost.jpg", "tags": ["x"]}).encode(),
        "meta/evil.json": json.dumps({"path": "../outside.jpg", "tags": ["x"]}).encode(),
        "meta/broken.json": b"{not json",
    }
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return d


def test_local_folder_to_shards_and_tokens(tmp_path, folder):
    root = tmp_path / "data"
    src = source(folder, samples_per_shard=4)
    adapter = adapter_for(src, PROFILE)
    index = index_source(root, src, adapter)
    assert index.dropped == {
        "bad_metadata": 1,
        "caption_encoding": 1,
        "empty_caption": 1,
        "excluded_tag": 1,
        "min_score": 1,
        "missing_caption": 1,
        "missing_image": 1,
        "unsafe_path": 1,
    }
    assert (index.num_in, index.num_out) == (15, 7)
    metadata = read_dir(root / "mine" / "metadata").to_pylist()
    captions = {r["origin"]: r["caption"] for r in metadata}
    assert captions["a/cat.jpg"] == "a cat on a mat"
    assert captions["t/one.jpg"] == "solo luna by=some_one"
    assert [r["key"] for r in metadata][:2] == ["000000000000", "000000000001"]
    assert len({r["key"] for r in metadata}) == 7

    kept, dropped = 0, {}
    for shard in ("00000", "00001"):
        stats = repack_shard(root, src, adapter, shard)
        kept += stats.num_out
        for reason, n in stats.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
    assert dropped == {"too_small": 1, "truncated": 1}
    assert kept == 5

    table = read_dir(root / "mine" / "shards").to_pylist()
    by_origin = {r["origin"]: r for r in table}
    assert by_origin["a/cat.jpg"]["status"] == "success"
    assert (by_origin["a/cat.jpg"]["width"], by_origin["a/cat.jpg"]["height"]) == (120, 90)
    assert by_origin["c/small.jpg"]["status"] == "too_small"
    assert by_origin["t/one.jpg"]["score"] == 300 and by_origin["t/one.jpg"]["tags"][0] == "solo"
    files = members(root / "mine" / "shards" / "00000.tar")
    gif_key = by_origin["c/anim.gif"]["key"]
    frame = np.asarray(Image.open(io.BytesIO(files[f"{gif_key}.jpg"])))
    assert frame.shape == (64, 64, 3)
    assert np.abs(frame.astype(int) - bad.RED).max() < 12  # the first frame, not green/blue
    dog = np.asarray(Image.open(io.BytesIO(files[f"{by_origin['a/dog.png']['key']}.jpg"])))
    assert dog.min() > 240  # fully transparent over white
    meta = json.loads(files[f"{by_origin['a/dog.png']['key']}.json"])
    assert meta["caption"] == "a dog, caf\u00e9 \U0001f436" and meta["origin"] == "a/dog.png"
    assert not (tmp_path / "outside.jpg").exists()

    # tokens for what filter-pixels would keep (every fetched sample here)
    shard_table = pq.read_table(root / "mine" / "shards" / "00000.parquet")
    ok = shard_table.filter(pc.equal(shard_table["status"], "success")).select(["key", "caption"])
    (root / "mine" / "selected").mkdir()
    pq.write_table(ok, root / "mine" / "selected" / "00000.parquet")
    stats = tokens.tokenize_shard(root, "mine", "00000")
    assert stats.num_out == ok.num_rows
    ids = pq.read_table(root / "mine" / "tokens" / "00000.parquet")
    expected = tokenize(ok["caption"].to_pylist()).numpy()
    np.testing.assert_array_equal(np.array(ids["input_ids"].to_pylist()), expected)


def test_a_missing_folder_is_one_clear_line(tmp_path):
    src = source(tmp_path / "nowhere")
    with pytest.raises(SourceError, match="folder .*nowhere does not exist"):
        check_source(src)
    with pytest.raises(SourceLayoutError, match="does not exist"):
        list(adapter_for(src, PROFILE).entries())


def test_an_unknown_layout_names_the_known_ones(tmp_path):
    src = Source(name="odd", kind="archive", location=str(tmp_path), license="t", profile="x")
    with pytest.raises(SourceError, match="no adapter .odd.*local"):
        check_source(src)
