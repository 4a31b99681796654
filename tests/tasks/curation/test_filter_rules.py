"""The metadata filter: which rows a profile keeps, and the one reason each dropped row gets."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import FilterProfile
from tasks.curation import filter as filter_stage
from tasks.curation import filter_pixels
from tests.tasks.metadata_rows import RECIPE, SCHEMA, SOURCE, row, write_metadata

PROFILE = RECIPE


def run_filter(
    root: Path, rows: list[dict], profile: FilterProfile = PROFILE, samples_per_shard: int = 100
):
    """Write `rows` as the source's metadata, filter it; returns (stats, kept rows in order)."""
    write_metadata(root, rows)
    stats = filter_stage.filter_metadata(root, SOURCE, profile, samples_per_shard)
    shards = sorted((root / SOURCE / "filtered").glob("[0-9]*.parquet"))
    kept = [r for path in shards for r in pq.read_table(path).to_pylist()]
    return stats, kept


def test_profile_keeps_exactly_the_rows_that_pass(tmp_path):
    rows = [
        row("a"),
        row("b", aesthetic=6.5, similarity=0.28, pwatermark=0.5, punsafe=0.5),  # on each edge
        row("c", aesthetic=6.49),
        row("d", similarity=0.27),
        row("e", pwatermark=0.51),
        row("f", punsafe=0.9),
        row("g", width=511.0),
        row("h", height=100.0),
        row("i", width=512.0, height=512.0),
    ]
    stats, kept = run_filter(tmp_path, rows)
    assert [r["key"] for r in kept] == ["a", "b", "i"]
    assert stats.dropped == {
        "aesthetic": 1,
        "similarity": 1,
        "pwatermark": 1,
        "punsafe": 1,
        "too_small": 2,
    }
    assert (stats.num_in, stats.num_out) == (len(rows), 3)


def test_a_declared_size_is_judged_only_when_it_is_known(tmp_path):
    # Metadata sizes: missing, NaN, zero or negative are unknown (the fetched pixels are
    # measured later), so only a known side under min_side fails; infinity is known and large.
    sizes = {
        "null": (None, None),
        "nan": (math.nan, math.nan),
        "negative": (-1.0, -5.0),
        "zero": (0.0, 0.0),
        "inf": (math.inf, 600.0),
        "nan_width_small_height": (math.nan, 100.0),
        "negative_width_small_height": (-1.0, 511.0),
        "small_width_null_height": (100.0, None),
        "exactly": (512.0, 512.0),
        "neg_inf_small": (-math.inf, 10.0),
    }
    rows = [row(k, width=w, height=h) for k, (w, h) in sizes.items()]
    stats, kept = run_filter(tmp_path, rows)
    failing = {"nan_width_small_height", "negative_width_small_height", "small_width_null_height"}
    failing.add("neg_inf_small")
    assert sorted(r["key"] for r in kept) == sorted(set(sizes) - failing)
    assert stats.dropped == {"too_small": len(failing)}


def test_kept_rows_keep_their_columns(tmp_path):
    _, kept = run_filter(tmp_path, [row("a")])
    assert kept == [row("a")]


@pytest.mark.parametrize("column", ["aesthetic", "similarity", "pwatermark", "punsafe"])
@pytest.mark.parametrize("missing", [None, math.nan], ids=["null", "nan"])
def test_missing_score_fails_its_rule(tmp_path, column, missing):
    stats, kept = run_filter(tmp_path, [row("a"), row("b", **{column: missing})])
    assert [r["key"] for r in kept] == ["a"]
    assert stats.dropped == {column: 1}


@pytest.mark.parametrize("missing", [None, math.nan], ids=["null", "nan"])
def test_missing_size_passes_the_metadata_size_rule(tmp_path, missing):
    # The size is checked again on the fetched pixels, so an unknown size must not drop a row.
    rows = [row("a", width=missing), row("b", width=missing, height=missing)]
    stats, kept = run_filter(tmp_path, rows)
    assert [r["key"] for r in kept] == ["a", "b"]
    assert stats.dropped == {}


def test_known_small_side_drops_even_when_the_other_is_missing(tmp_path):
    stats, kept = run_filter(tmp_path, [row("a", width=math.nan, height=100.0)])
    assert kept == []
    assert stats.dropped == {"too_small": 1}


def test_duplicate_urls_keep_the_smallest_key(tmp_path):
    rows = [
        row("c", url="http://x/same.jpg"),
        row("a", url="http://x/same.jpg"),
        row("b", url="http://x/same.jpg"),
        row("d"),
    ]
    stats, kept = run_filter(tmp_path, rows)
    assert [r["key"] for r in kept] == ["a", "d"]
    assert stats.dropped == {"duplicate_url": 2}


def test_duplicate_is_judged_among_rows_that_pass_every_other_rule(tmp_path):
    # The smallest key fails a score rule, so the next copy is the one that survives.
    rows = [
        row("a", url="http://x/same.jpg", aesthetic=1.0),
        row("b", url="http://x/same.jpg"),
        row("c", url="http://x/same.jpg"),
    ]
    stats, kept = run_filter(tmp_path, rows)
    assert [r["key"] for r in kept] == ["b"]
    assert stats.dropped == {"aesthetic": 1, "duplicate_url": 1}


def test_each_dropped_row_is_counted_once_under_its_first_failing_rule(tmp_path):
    # Waterfall order: too_small, aesthetic, similarity, pwatermark, punsafe.
    every_score_fails = {"aesthetic": 1.0, "similarity": 0.0, "pwatermark": 1.0, "punsafe": 1.0}
    rows = [
        row("b", width=10.0, **every_score_fails),
        row("c", **every_score_fails),
        row("d", **{**every_score_fails, "aesthetic": 7.0}),
        row("e", pwatermark=1.0, punsafe=1.0),
        row("f", punsafe=1.0),
    ]
    stats, kept = run_filter(tmp_path, rows)
    assert kept == []
    assert stats.dropped == {
        "too_small": 1,
        "aesthetic": 1,
        "similarity": 1,
        "pwatermark": 1,
        "punsafe": 1,
    }


def test_disabled_rules_drop_nothing(tmp_path):
    open_profile = FilterProfile(name="open")
    rows = [row("a", aesthetic=None, similarity=math.nan, width=1.0), row("b")]
    stats, kept = run_filter(tmp_path, rows, open_profile)
    assert [r["key"] for r in kept] == ["a", "b"]
    assert stats.dropped == {}


def test_kept_rows_are_split_into_shards_in_key_order(tmp_path):
    rows = [row(f"{i:03d}") for i in reversed(range(25))]
    stats, kept = run_filter(tmp_path, rows, samples_per_shard=10)
    shards = sorted(p.name for p in (tmp_path / SOURCE / "filtered").glob("[0-9]*.parquet"))
    assert shards == ["00000.parquet", "00001.parquet", "00002.parquet"]
    assert stats.extra["num_shards"] == 3
    assert [r["key"] for r in kept] == [f"{i:03d}" for i in range(25)]


def test_empty_metadata_gives_zero_rows(tmp_path):
    stats, kept = run_filter(tmp_path, [])
    assert (stats.num_in, stats.num_out, stats.dropped) == (0, 0, {})
    assert stats.extra["num_shards"] == 0
    assert kept == []


def test_pixel_selection_after_everything_was_filtered_out(tmp_path):
    # A profile that drops every metadata row leaves no shard to fetch; the pixel stage that
    # follows must still complete, with nothing selected.
    stats, _ = run_filter(tmp_path, [row("a", aesthetic=1.0)])
    assert stats.num_out == 0
    selected = filter_pixels.select_pixels(tmp_path, SOURCE, PROFILE)
    assert (selected.num_in, selected.num_out, selected.skipped) == (0, 0, False)
    assert list((tmp_path / SOURCE / "selected").glob("[0-9]*.parquet")) == []


def test_rerun_is_skipped_and_keeps_the_output(tmp_path):
    first, _ = run_filter(tmp_path, [row("a"), row("b", aesthetic=1.0)])
    shard = tmp_path / SOURCE / "filtered" / "00000.parquet"
    mtime = shard.stat().st_mtime_ns
    again = filter_stage.filter_metadata(tmp_path, SOURCE, PROFILE, 100)
    assert again.skipped
    assert (again.num_in, again.num_out, again.dropped) == (
        first.num_in,
        first.num_out,
        first.dropped,
    )
    assert shard.stat().st_mtime_ns == mtime


def test_an_edited_build_profile_is_refused_not_silently_ignored(tmp_path):
    # The filtered rows were fetched, scored and encoded further on: a finished unit built under
    # other settings is neither reused as if nothing changed nor rebuilt under the stages built
    # from it. The error names the change and what to delete; nothing is touched.
    run_filter(tmp_path, [row("a"), row("b", aesthetic=6.0)])
    filtered = tmp_path / SOURCE / "filtered"
    before = {p.name: p.read_bytes() for p in filtered.iterdir()}
    looser = dataclasses.replace(PROFILE, min_aesthetic=5.5)
    with pytest.raises(filter_stage.ProfileChanged) as info:
        filter_stage.filter_metadata(tmp_path, SOURCE, looser, 100)
    message = str(info.value)
    assert "profile 'recipe' changed" in message and "min_aesthetic: 6.5 -> 5.5" in message
    assert str(filtered) in message and "shards, scores, selected" in message
    assert {p.name: p.read_bytes() for p in filtered.iterdir()} == before
    # The same settings are still a finished unit; deleting the output rebuilds under the new.
    assert filter_stage.filter_metadata(tmp_path, SOURCE, PROFILE, 100).skipped
    shutil.rmtree(filtered)
    assert filter_stage.filter_metadata(tmp_path, SOURCE, looser, 100).num_out == 2


def test_an_edited_profile_is_refused_by_the_pixel_selection_too(tmp_path):
    run_filter(tmp_path, [row("a", aesthetic=1.0)])
    filter_pixels.select_pixels(tmp_path, SOURCE, PROFILE)
    stricter = dataclasses.replace(PROFILE, dedup=("url", "sha256", "phash"))
    with pytest.raises(filter_stage.ProfileChanged, match=r"dedup: \['url', 'sha256'\] -> "):
        filter_pixels.select_pixels(tmp_path, SOURCE, stricter)
    assert filter_pixels.select_pixels(tmp_path, SOURCE, PROFILE).skipped


def test_a_record_from_before_profiles_were_recorded_is_accepted(tmp_path):
    run_filter(tmp_path, [row("a")])
    record = tmp_path / SOURCE / "filtered" / f"{filter_stage.ALL}.stats.json"
    stats = json.loads(record.read_text())
    del stats["extra"]["profile_settings"]
    record.write_text(json.dumps(stats))
    looser = dataclasses.replace(PROFILE, min_aesthetic=5.5)
    assert filter_stage.filter_metadata(tmp_path, SOURCE, looser, 100).skipped


def test_a_record_from_before_a_profile_field_existed_reads_it_as_its_default(tmp_path):
    # score_tags and tag_bonus_scores came after data roots were built: a record without them
    # is the same settings, not an edit (else every older data root would be refused).
    run_filter(tmp_path, [row("a")])
    record = tmp_path / SOURCE / "filtered" / f"{filter_stage.ALL}.stats.json"
    stats = json.loads(record.read_text())
    for added in ("score_tags", "tag_bonus_scores", "abs_min_score"):
        del stats["extra"]["profile_settings"][added]
    record.write_text(json.dumps(stats))
    assert filter_stage.filter_metadata(tmp_path, SOURCE, PROFILE, 100).skipped
    tagged = dataclasses.replace(PROFILE, score_tags=(100.0, 50.0))
    with pytest.raises(filter_stage.ProfileChanged, match=r"score_tags: \[\] -> \[100.0, 50.0\]"):
        filter_stage.filter_metadata(tmp_path, SOURCE, tagged, 100)


def test_metadata_files_with_other_columns_are_read_by_name(tmp_path):
    # A source's metadata written by two versions (an extra column, another column order) is
    # one relation, matched by name; a file lacking the extra column reads it as null.
    write_metadata(tmp_path, [row("a"), row("b", aesthetic=1.0)])
    extra = pa.Table.from_pylist([row("c")], schema=SCHEMA).append_column(
        "license", pa.array(["cc"])
    )
    order = list(reversed(extra.column_names))
    pq.write_table(extra.select(order), tmp_path / SOURCE / "metadata" / "00001.parquet")
    stats = filter_stage.filter_metadata(tmp_path, SOURCE, PROFILE, 100)
    kept = pq.read_table(tmp_path / SOURCE / "filtered" / "00000.parquet").to_pylist()
    assert [(r["key"], r["license"]) for r in kept] == [("a", None), ("c", "cc")]
    assert stats.dropped == {"aesthetic": 1}
