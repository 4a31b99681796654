"""Profile rules beyond the score thresholds, and bad input: out-of-range scores, unknown sizes,
repeated keys, caption rules and blocklists, and a profile naming a column the rows lack."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import FilterProfile
from tasks.curation import filter as filter_stage
from tasks.curation import filter_pixels

GOOD = {"width": 800.0, "height": 600.0, "similarity": 0.3, "punsafe": 0.1}
GOOD |= {"pwatermark": 0.1, "aesthetic": 7.0}
SCORED = FilterProfile(
    name="scored", min_aesthetic=5, min_similarity=0.2, max_pwatermark=0.5, max_punsafe=0.5
)


def row(key: str, **overrides) -> dict:
    return {"key": key, "url": f"http://x.org/{key}.jpg", "caption": f"a photo {key}", **GOOD} | (
        overrides
    )


def run(root, files: list[list[dict]], profile: FilterProfile):
    """Write each list as one metadata file (in order); filter; returns (stats, kept keys)."""
    (root / "src" / "metadata").mkdir(parents=True)
    schema = pa.Table.from_pylist([row("s")]).schema
    for i, rows in enumerate(files):
        table = pa.Table.from_pylist(rows, schema=schema)
        pq.write_table(table, root / "src" / "metadata" / f"part-{i}.parquet")
    stats = filter_stage.filter_metadata(root, "src", profile, 1000)
    kept = [
        r
        for p in sorted((root / "src" / "filtered").glob("[0-9]*.parquet"))
        for r in pq.read_table(p).to_pylist()
    ]
    return stats, kept


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("aesthetic", 10.5),
        ("aesthetic", -1.0),
        ("similarity", 1.5),
        ("pwatermark", -0.2),
        ("punsafe", -0.1),
        ("punsafe", 1.5),
    ],
)
def test_out_of_range_score_fails_its_rule(tmp_path, column, value):
    stats, kept = run(tmp_path, [[row("a"), row("b", **{column: value})]], SCORED)
    assert [r["key"] for r in kept] == ["a"]
    assert stats.dropped == {column: 1}


@pytest.mark.parametrize("side", [-5.0, 0.0])
def test_non_positive_size_is_unknown_metadata_passes_pixels_fail(tmp_path, fetched, scene, side):
    profile = FilterProfile(name="size", min_side=256, dedup=())
    stats, kept = run(tmp_path / "meta", [[row("a", width=side, height=side)]], profile)
    assert [r["key"] for r in kept] == ["a"]
    rows = [
        {"key": "a", "caption": "x", "width": side, "height": side, "image": scene(0)},
        {"key": "b", "caption": "y", "width": 300.0, "height": 300.0, "image": scene(1)},
    ]
    fetched(tmp_path / "pix", "src", rows)
    stats = filter_pixels.select_pixels(tmp_path / "pix", "src", profile)
    assert stats.dropped == {"too_small": 1}
    assert (stats.num_in, stats.num_out) == (2, 1)


@pytest.mark.parametrize("unknown", [None, float("nan"), -1.0, 0.0])
def test_one_unknown_pixel_side_fails_the_size_rule(tmp_path, fetched, scene, unknown):
    # The other side is well above the floor: an unknown side still cannot be shown to pass
    # (DuckDB's least() skips NULL, so (NULL, 600) once passed min_side 512).
    profile = FilterProfile(name="size", min_side=512, dedup=())
    rows = [
        {"key": "w", "caption": "x", "width": unknown, "height": 600.0, "image": scene(0)},
        {"key": "h", "caption": "y", "width": 600.0, "height": unknown, "image": scene(1)},
        {"key": "ok", "caption": "z", "width": 600.0, "height": 600.0, "image": scene(2)},
    ]
    fetched(tmp_path, "src", rows)
    stats = filter_pixels.select_pixels(tmp_path, "src", profile)
    assert stats.dropped == {"too_small": 2}
    kept = pq.read_table(tmp_path / "src" / "selected" / "00000.parquet")["key"].to_pylist()
    assert kept == ["ok"]


def test_repeated_key_keeps_its_first_copy_in_file_order(tmp_path):
    first = [row("a", caption="first"), row("b")]
    second = [row("a", url="http://x.org/other.jpg", caption="second")]
    stats, kept = run(tmp_path, [first, second], FilterProfile(name="open", dedup=("url",)))
    assert [(r["key"], r["caption"]) for r in kept] == [("a", "first"), ("b", "a photo b")]
    assert stats.dropped == {"duplicate_key": 1}


def test_caption_rules(tmp_path):
    profile = FilterProfile(
        name="captions",
        min_caption_words=3,
        caption_blocklist=("stock photo", "watermark"),
        dedup=(),
    )
    rows = [
        row("ok", caption="a red circle on grass"),
        row("short", caption="red  circle"),
        row("blank", caption="   "),
        row("none", caption=None),
        row("blocked", caption="Cat, STOCK   photo of a cat"),
        row("word", caption="a watermark on a cat"),
        row("partial", caption="three watermarked cats here"),  # not the whole word
    ]
    stats, kept = run(tmp_path, [rows], profile)
    assert [r["key"] for r in kept] == ["ok", "partial"]
    assert stats.dropped == {"short_caption": 3, "caption_blocklist": 2}


def test_url_blocklist_matches_the_domain_and_its_subdomains_only(tmp_path):
    profile = FilterProfile(name="domains", url_blocklist=("shutterstock.com",), dedup=())
    rows = [
        row("sub", url="https://image.Shutterstock.com/z/1.jpg"),
        row("bare", url="http://shutterstock.com:8080/a.jpg?x=1"),
        row("suffix", url="https://notshutterstock.com/a.jpg"),
        row("prefix", url="https://shutterstock.com.example.org/a.jpg"),
        row("path", url="https://example.org/shutterstock.com/a.jpg"),
    ]
    stats, kept = run(tmp_path, [rows], profile)
    assert [r["key"] for r in kept] == ["path", "prefix", "suffix"]
    assert stats.dropped == {"url_blocklist": 2}


def test_min_and_max_of_any_column(tmp_path):
    profile = FilterProfile(name="cols", min_values={"width": 500}, max_values={"height": 700})
    rows = [row("a"), row("b", width=400.0), row("c", height=701.0), row("d", height=None)]
    stats, kept = run(tmp_path, [rows], profile)
    assert [r["key"] for r in kept] == ["a"]
    assert stats.dropped == {"min_width": 1, "max_height": 2}


def test_profile_naming_an_unknown_column_lists_the_available_ones(tmp_path):
    profile = FilterProfile(name="people", min_values={"person_height": 0.55})
    with pytest.raises(filter_stage.ProfileError) as info:
        run(tmp_path, [[row("a")]], profile)
    message = str(info.value)
    assert "\n" not in message
    assert "'person_height'" in message and "people" in message
    assert "available: key, url, caption, width, height" in message


def test_scores_the_metadata_lacks_wait_for_the_score_stage(tmp_path):
    # Metadata without an aesthetic column: with a scorer the rule waits for the pixels;
    # without one, the profile asks for something no stage will provide.
    rows = [{k: v for k, v in row("a").items() if k != "aesthetic"}]
    for source in ("a", "b"):
        (tmp_path / source / "metadata").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / source / "metadata" / "0.parquet")
    scored = FilterProfile(name="scored", min_aesthetic=5, scorer="tiny-scoring")
    stats = filter_stage.filter_metadata(tmp_path, "a", scored, 100)
    assert (stats.num_out, stats.dropped) == (1, {})
    unscored = FilterProfile(name="unscored", min_aesthetic=5)
    with pytest.raises(filter_stage.ProfileError, match="'aesthetic'.*set `scorer`"):
        filter_stage.filter_metadata(tmp_path, "b", unscored, 100)


def test_nan_scores_fail_whatever_the_file_statistics_say(tmp_path):
    # Parquet statistics leave NaN out of min/max; a query planner that trusts them would
    # decide `aesthetic <= 10` for whole row groups and let their NaN rows through.
    rng = np.random.default_rng(0)
    aesthetic = rng.uniform(0, 9.5, 2000)
    aesthetic[rng.random(2000) < 0.1] = np.nan
    table = pa.Table.from_pylist([row(f"{i:05d}") for i in range(2000)])
    table = table.set_column(table.schema.get_field_index("aesthetic"), "aesthetic", [aesthetic])
    (tmp_path / "src" / "metadata").mkdir(parents=True)
    pq.write_table(table, tmp_path / "src" / "metadata" / "0.parquet", row_group_size=256)
    stats = filter_stage.filter_metadata(tmp_path, "src", SCORED, 10_000)
    expected = int(((aesthetic >= 5) & (aesthetic <= 10)).sum())
    assert stats.num_out == expected
    assert stats.dropped == {"aesthetic": 2000 - expected}
