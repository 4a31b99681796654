"""A removal from an archive-kind source holds at the next build: its index drops the removed
origins and its repack the removed images' bytes (`removed`), so a rebuild into a fresh root that
shares the removals folder does not bring them back, and every other row keeps its key."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq

from catalog import FilterProfile, Source
from tasks.removal import apply, lists
from tasks.runtime.shards import read_stats, summarize
from tasks.sources.adapters import adapter_for, index_source, repack_shard, shard_names
from tests.tasks import bad_images as bad
from tests.tasks.fixtures_archives import members, read_dir

PROFILE = FilterProfile(name="plain", min_side=32)
NAME = "mine"


def source(location) -> Source:
    return Source(
        name=NAME, location=str(location), kind="folder", adapter="local", license="test",
        profile="plain", resolution=64, samples_per_shard=4,
    )  # fmt: skip


def image(i: int) -> bytes:
    return bad.jpeg(64 + i, 64, color=(20 * i, 200 - 20 * i, 90))


def build(root, folder) -> dict[str, int]:
    """index + repack of every shard; {reason: rows dropped} over both stages."""
    src = source(folder)
    adapter = adapter_for(src, PROFILE)
    dropped: dict[str, int] = dict(index_source(root, src, adapter).dropped)
    for shard in shard_names(root, NAME):
        for reason, n in repack_shard(root, src, adapter, shard).dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
    return dropped


def test_a_rebuild_of_an_archive_source_does_not_bring_removed_rows_back(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(8):
        (folder / f"{i}.jpg").write_bytes(image(i))
        (folder / f"{i}.txt").write_text(f"caption number {i}")
    root = tmp_path / "data"
    assert build(root, folder) == {}
    rows = {r["origin"]: r for r in read_dir(root / NAME / "shards").to_pylist()}
    # One named by key, one by the sha256 of its bytes (as `sdpipe remove` takes them).
    listed = tmp_path / "takedown.txt"
    listed.write_text(f"{rows['2.jpg']['key']}\n{rows['5.jpg']['sha256']}\n")
    record = apply.remove(root, NAME, lists.read_list(listed), PROFILE, scored=False)
    assert record["num_rows"] == 2
    gone = {rows["2.jpg"]["key"], rows["5.jpg"]["key"]}
    index = summarize(read_stats(root, NAME, "metadata"))  # counted once, at the index
    assert (index["num_in"], index["num_out"], index["dropped"]) == (8, 6, {"removed": 2})
    assert summarize(read_stats(root, NAME, "shards"))["num_in"] == 6

    # A fresh root sharing the removals folder; upstream gained a copy of 5.jpg at another path.
    (folder / "z.jpg").write_bytes(image(5))
    (folder / "z.txt").write_text("the same picture again")
    fresh = tmp_path / "fresh"
    shutil.copytree(root / NAME / lists.FOLDER, fresh / NAME / lists.FOLDER)
    assert build(fresh, folder) == {"removed": 3}  # two by origin at index, one by sha256
    metadata = read_dir(fresh / NAME / "metadata").to_pylist()
    shards = read_dir(fresh / NAME / "shards").to_pylist()
    assert {"2.jpg", "5.jpg"}.isdisjoint(r["origin"] for r in metadata + shards)
    assert "z.jpg" not in {r["origin"] for r in shards}
    captions = [r["caption"] for r in shards]
    assert "caption number 2" not in captions and "the same picture again" not in captions
    removed_bytes = {rows["5.jpg"]["sha256"], rows["2.jpg"]["sha256"]}
    assert removed_bytes.isdisjoint(r["sha256"] for r in shards)
    assert all(r["status"] == "success" for r in shards) and len(shards) == 6
    # Every other row keeps its key: lineage and phase sets name rows by key.
    for r in shards:
        if r["origin"] != "z.jpg":
            assert r["key"] == rows[r["origin"]]["key"]
    tars = {}
    for tar in sorted((fresh / NAME / "shards").glob("*.tar")):
        tars |= members(tar)
    assert not any(name.split(".")[0] in gone for name in tars)
    assert len([n for n in tars if n.endswith(".jpg")]) == 6
    assert np.all(pq.read_table(lists.blocklist_path(fresh, NAME))["origin"].is_valid())
