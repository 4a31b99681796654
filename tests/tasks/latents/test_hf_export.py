"""hf export: token shards -> a `datasets` DatasetDict {train, validation} under `hf/`."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.curation.selection import write_shards
from tasks.latents import hf_export
from tasks.latents.hf_export import export_done, export_hf_dataset, in_validation
from tasks.latents.tokenize import tokenize_shard
from tasks.runtime.shards import ShardStats

SHARD_ROWS = {"00000": 120, "00001": 90, "00002": 0}
SELECTED = pa.schema({"key": pa.string(), "caption": pa.string()})


def write_source(root, source: str = "src") -> dict[str, str]:
    """Selected shards with a few unusable captions, tokenized; returns key -> caption kept."""
    kept = {}
    for shard, n in SHARD_ROWS.items():
        keys = [f"{shard}-{i:04d}" for i in range(n)]
        captions = [f"  photo {i} of shard {shard} 🐱 " if i % 17 else "   " for i in range(n)]
        (root / source / "selected").mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table({"key": keys, "caption": captions}, schema=SELECTED),
            root / source / "selected" / f"{shard}.parquet",
        )
        tokenize_shard(root, source, shard)
        kept.update({k: c.strip() for k, c in zip(keys, captions, strict=True) if c.strip()})
    return kept


def test_export_loads_with_the_right_rows_and_columns(tmp_path):
    kept = write_source(tmp_path)
    stats = export_hf_dataset(tmp_path, "src", val_fraction=0.2, seed=3)
    assert not stats.skipped
    assert (stats.num_in, stats.num_out, stats.dropped) == (len(kept), len(kept), {})
    assert stats.extra["train"] + stats.extra["validation"] == len(kept)
    assert stats.extra["shards"] == 3

    dd = datasets.load_from_disk(str(tmp_path / "src" / "hf"))
    assert set(dd) == {"train", "validation"}
    for split in dd.values():
        assert split.column_names == ["key", "caption", "input_ids", "shard"]
        assert split.features["input_ids"] == datasets.List(datasets.Value("int32"), length=77)
    assert (dd["train"].num_rows, dd["validation"].num_rows) == (
        stats.extra["train"],
        stats.extra["validation"],
    )
    assert 0.1 < dd["validation"].num_rows / len(kept) < 0.3
    rows = {r["key"]: r for split in dd.values() for r in split}
    assert set(rows) == set(kept)
    tokens = pq.read_table(tmp_path / "src" / "tokens" / "00001.parquet").to_pylist()
    for t in tokens:
        row = rows[t["key"]]
        assert row["input_ids"] == t["input_ids"]
        assert row["caption"] == kept[t["key"]]
        assert row["shard"] == "00001"
    val = set(dd["validation"]["key"])
    assert val == {k for k, v in zip(kept, in_validation(list(kept), 3, 0.2), strict=True) if v}
    # Row order within a split: shard order, then row order.
    assert dd["train"]["key"] == sorted(dd["train"]["key"])
    # The stats record sits in hf/ and marks the export done: a second call skips.
    record = ShardStats.read(tmp_path / "src" / "hf" / "all.stats.json")
    assert record.num_out == len(kept)
    assert export_hf_dataset(tmp_path, "src", val_fraction=0.2, seed=3).skipped
    with pytest.raises(ValueError, match="remove it to export again"):
        export_hf_dataset(tmp_path, "src", val_fraction=0.2, seed=4)


def test_split_depends_on_key_and_seed_only():
    keys = [f"key-{i}" for i in range(20_000)]
    a = in_validation(keys, 0, 0.01)
    assert 150 < a.sum() < 250
    # Any order or subset of keys: each key keeps its split.
    perm = np.random.default_rng(0).permutation(len(keys))
    assert (in_validation([keys[i] for i in perm], 0, 0.01) == a[perm]).all()
    assert (in_validation(keys[5000:6000], 0, 0.01) == a[5000:6000]).all()
    # Another seed: another split; a bigger fraction: a superset.
    assert (in_validation(keys, 1, 0.01) != a).any()
    assert (in_validation(keys, 0, 0.05) | ~a).all()
    assert not in_validation(keys, 0, 0.0).any() and in_validation(keys, 0, 1.0).all()


def test_split_does_not_depend_on_shard_order(tmp_path):
    write_source(tmp_path / "a")
    export_hf_dataset(tmp_path / "a", "src", val_fraction=0.3, seed=7)
    # The same rows, sharded the other way round.
    write_source(tmp_path / "b")
    for name in ("selected", "tokens"):
        d = tmp_path / "b" / "src" / name
        (d / "00000.parquet").rename(d / "tmp.parquet")
        (d / "00001.parquet").rename(d / "00000.parquet")
        (d / "tmp.parquet").rename(d / "00001.parquet")
    export_hf_dataset(tmp_path / "b", "src", val_fraction=0.3, seed=7)
    a = datasets.load_from_disk(str(tmp_path / "a" / "src" / "hf"))
    b = datasets.load_from_disk(str(tmp_path / "b" / "src" / "hf"))
    for split in ("train", "validation"):
        assert set(a[split]["key"]) == set(b[split]["key"])


def test_missing_captions_are_dropped_and_counted(tmp_path):
    kept = write_source(tmp_path)
    selected = tmp_path / "src" / "selected" / "00000.parquet"
    table = pq.read_table(selected)
    pq.write_table(table.slice(10), selected)  # the first 10 rows re-selected away
    lost = sum(1 for k in kept if k.startswith("00000-") and int(k[-4:]) < 10)
    stats = export_hf_dataset(tmp_path, "src", val_fraction=0.0)
    assert stats.dropped == {"missing_caption": lost}
    assert (stats.num_in, stats.num_out) == (len(kept), len(kept) - lost)
    dd = datasets.load_from_disk(str(tmp_path / "src" / "hf"))
    assert (dd["train"].num_rows, dd["validation"].num_rows) == (len(kept) - lost, 0)


def test_killed_export_leaves_no_half_folder_and_reruns(tmp_path, monkeypatch):
    kept = write_source(tmp_path)
    source_dir = tmp_path / "src"

    def die(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill mid-save would stop it: no cleanup runs past it

    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", die)
    with pytest.raises(KeyboardInterrupt):
        export_hf_dataset(tmp_path, "src")
    monkeypatch.undo()
    assert not (source_dir / "hf").exists()

    # A leftover hidden folder from a SIGKILLed run, and a hf/ renamed into place by a run
    # killed before its stats record: the next run removes the first and replaces the second.
    leftover = source_dir / ".hf.work.tmp-99999"
    (leftover / "dataset").mkdir(parents=True)
    (source_dir / "hf").mkdir()
    (source_dir / "hf" / "stale.txt").write_text("old")
    stats = export_hf_dataset(tmp_path, "src")
    assert stats.num_out == len(kept)
    assert not leftover.exists()
    assert not (source_dir / "hf" / "stale.txt").exists()
    assert [p.name for p in source_dir.iterdir() if p.name.startswith(".")] == []
    dd = datasets.load_from_disk(str(source_dir / "hf"))
    assert dd["train"].num_rows + dd["validation"].num_rows == len(kept)
    info = json.loads((source_dir / "hf" / "dataset_dict.json").read_text())
    assert info["splits"] == ["train", "validation"]


def test_bad_fraction_is_refused(tmp_path):
    with pytest.raises(ValueError, match="val_fraction"):
        export_hf_dataset(tmp_path, "src", val_fraction=1.5)
    assert hf_export.STAGE == "hf"


def reselect(root, changed: dict[str, list[str]]) -> None:
    """filter-pixels runs again and keeps, of each shard in `changed`, those keys (their tokens
    record forgotten, as a re-selection does), which are tokenized again; the other shards keep
    their rows."""
    selected = root / "src" / "selected"
    paths = [root / "src" / "shards" / f"{s}.parquet" for s in sorted(SHARD_ROWS)]
    tables = []
    for p in paths:
        table = pq.read_table(selected / p.name)
        if (keys := changed.get(p.stem)) is not None:
            captions = [f"new photo {k}" for k in keys]
            table = pa.table({"key": keys, "caption": captions}, schema=SELECTED)
        tables.append(
            table.append_column("filename", pa.array([str(p)] * table.num_rows, pa.string()))
        )
    assert write_shards(root, "src", pa.concat_tables(tables), paths) == len(changed)
    for shard in changed:
        tokenize_shard(root, "src", shard)


def exported(root) -> dict[str, dict]:
    dd = datasets.load_from_disk(str(root / "src" / "hf"))
    return {r["key"]: r for split in dd.values() for r in split}


def test_a_shard_tokenized_again_is_exported_again(tmp_path):
    kept = write_source(tmp_path)
    export_hf_dataset(tmp_path, "src", val_fraction=0.2, seed=3)
    assert export_done(tmp_path, "src")
    # A re-score keeps other rows of 00001: some dropped, some new.
    keys = [f"00001-{i:04d}" for i in range(30, 90)] + ["00001-0100", "00001-0101"]
    reselect(tmp_path, {"00001": keys})
    assert not export_done(tmp_path, "src")  # what the flow asks before it trusts its cache

    stats = export_hf_dataset(tmp_path, "src", val_fraction=0.2, seed=3)
    assert not stats.skipped
    rows = exported(tmp_path)
    assert {k for k in rows if k.startswith("00001-")} == set(keys)
    assert rows["00001-0100"]["caption"] == "new photo 00001-0100"
    others = {k for k in kept if not k.startswith("00001-")}
    assert {k for k in rows if not k.startswith("00001-")} == others
    assert stats.num_out == len(others) + len(keys)
    assert export_done(tmp_path, "src")


def test_a_new_token_shard_is_exported_and_old_keys_keep_their_split(tmp_path):
    kept = write_source(tmp_path)
    export_hf_dataset(tmp_path, "src", val_fraction=0.3, seed=1)
    before = set(datasets.load_from_disk(str(tmp_path / "src" / "hf"))["validation"]["key"])
    keys = [f"00003-{i:04d}" for i in range(40)]
    pq.write_table(
        pa.table({"key": keys, "caption": [f"photo {k}" for k in keys]}, schema=SELECTED),
        tmp_path / "src" / "selected" / "00003.parquet",
    )
    tokenize_shard(tmp_path, "src", "00003")

    stats = export_hf_dataset(tmp_path, "src", val_fraction=0.3, seed=1)
    assert not stats.skipped
    assert stats.extra["shards"] == 4
    assert set(exported(tmp_path)) == set(kept) | set(keys)
    after = set(datasets.load_from_disk(str(tmp_path / "src" / "hf"))["validation"]["key"])
    assert after - set(keys) == before


def test_unchanged_tokens_are_not_exported_again(tmp_path):
    write_source(tmp_path)
    export_hf_dataset(tmp_path, "src")
    hf = tmp_path / "src" / "hf"
    files = {p: p.stat().st_mtime_ns for p in hf.rglob("*") if p.is_file()}
    # filter-pixels run again, keeping the same rows: it rewrites every selection file, but
    # no shard is tokenized again.
    reselect(tmp_path, {})
    assert export_done(tmp_path, "src")
    assert export_hf_dataset(tmp_path, "src").skipped
    assert {p: p.stat().st_mtime_ns for p in hf.rglob("*") if p.is_file()} == files


def test_a_killed_export_again_leaves_the_previous_export(tmp_path, monkeypatch):
    kept = write_source(tmp_path)
    export_hf_dataset(tmp_path, "src")
    reselect(tmp_path, {"00001": [f"00001-{i:04d}" for i in range(1, 10)]})
    read_rows = hf_export._shard_rows

    def die_on_00001(root, source, shard, stats):
        if shard == "00001":
            raise KeyboardInterrupt  # a kill midway through the split files
        return read_rows(root, source, shard, stats)

    monkeypatch.setattr(hf_export, "_shard_rows", die_on_00001)
    with pytest.raises(KeyboardInterrupt):
        export_hf_dataset(tmp_path, "src")
    monkeypatch.undo()
    # The previous export, whole, and not taken for a current one.
    assert set(exported(tmp_path)) == set(kept)
    assert not export_done(tmp_path, "src")
    assert not export_hf_dataset(tmp_path, "src").skipped
    assert {k for k in exported(tmp_path) if k.startswith("00001-")} == {
        f"00001-{i:04d}" for i in range(1, 10)
    }
