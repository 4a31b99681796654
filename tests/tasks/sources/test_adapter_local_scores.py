"""Seed 002's score settings on tagged local folders: abs_min_score, tag bonuses, score tags.

The profile is seed 002's example dataloader config; every expected caption and reason below
is worked out by hand from it.
"""

from __future__ import annotations

import json

import pytest

from catalog import FilterProfile, Source
from tasks.sources.adapters import adapter_for, index_source
from tasks.sources.adapters.base import Entry, Refused
from tasks.sources.adapters.local import score_tag
from tests.tasks import bad_images as bad
from tests.tasks.fixtures_archives import read_dir

SEED_002 = FilterProfile(
    name="seed002",
    exclude_tags=("animated", "machine learning generated"),
    remove_tags=("high res",),
    tag_replacements={"princess luna": "luna", " ": "_"},
    tag_separator=" ",
    abs_min_score=50,
    min_score=200,
    score_tags=(3200, 1600, 800, 600, 400, 300, 200, 150, 100, 50, 25, 5),
    tag_bonus_scores={
        "solo": 100,
        "duo": 100,
        "pride flag": 50,
        "monochrome": -75,
        "grayscale": -75,
        "sketch": -75,
    },
)

# (tags, score) -> the caption kept, or the reason it is dropped.
CASES = [
    (["pony"], 3500, "scr3200 pony"),
    (["pony"], 3200, "scr1600 pony"),  # exceeds strictly: 3200 is not over 3200
    (["solo"], 150, "scr100 solo"),  # 150 + 100 = 250 >= 200; the tag is the raw score's
    (["pony", "monochrome"], 250, "min_score"),  # 250 - 75 = 175 < 200
    (["solo"], 40, "abs_min_score"),  # under 50 before any bonus (40 + 100 would pass)
    (["pony"], 200, "scr150 pony"),  # exactly min_score is kept; 200 is over 150, not 200
    (["solo", "duo"], 50, "scr25 solo duo"),  # 50 is not under 50; 50 + 200 = 250
    (["solo", "solo"], 99, "min_score"),  # a tag's bonus counts once: 99 + 100 < 200
    (["sketch", "solo", "princess luna", "high res"], 180, "scr150 sketch solo luna"),  # 180 + 25
    (["animated", "solo"], 10, "excluded_tag"),  # excluded before the score rules
    (["pony"], None, "abs_min_score"),  # no score: fails the rules that need one
]


def entry(profile: FilterProfile, tags: list[str], score) -> Entry | Refused:
    src = Source(
        name="mine", kind="folder", adapter="local", location="/nowhere", license="t", profile="x"
    )
    return adapter_for(src, profile).tagged("a.jpg", {"tags": tags, "score": score})


@pytest.mark.parametrize(("tags", "score", "expected"), CASES)
def test_seed_002_scores_by_hand(tags, score, expected):
    got = entry(SEED_002, tags, score)
    if isinstance(got, Refused):
        assert got.reason == expected
    else:
        assert got.caption == expected
        assert got.extras == {"score": score, "tags": tags}  # the raw score and tags are kept


def test_score_tags_without_score_floors():
    loose = FilterProfile(name="loose", tag_separator=", ", score_tags=SEED_002.score_tags)
    assert entry(loose, ["pony"], 3).caption == "pony"  # 3 exceeds no threshold: no tag
    assert entry(loose, ["pony"], 5).caption == "pony"  # nor does 5 (strictly)
    assert entry(loose, ["pony", "solo"], 6).caption == "scr5, pony, solo"
    assert entry(loose, ["pony"], None).caption == "pony"
    assert entry(loose, [], 700).caption == "scr600"  # a score tag alone is a caption
    assert score_tag(2.75, (2.5, 1.0)) == "scr2.5"  # a fractional threshold is written as is


def test_refusals_are_counted_in_the_index_stats(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for i, (tags, score, _) in enumerate(CASES):
        (folder / f"{i:02d}.jpg").write_bytes(bad.jpeg())
        (folder / f"{i:02d}.json").write_text(json.dumps({"tags": tags, "score": score}))
    src = Source(
        name="mine",
        kind="folder",
        adapter="local",
        location=str(folder),
        license="t",
        profile="seed002",
        resolution=64,
    )
    stats = index_source(tmp_path / "data", src, adapter_for(src, SEED_002))
    assert stats.dropped == {"min_score": 2, "abs_min_score": 2, "excluded_tag": 1}
    assert (stats.num_in, stats.num_out) == (len(CASES), len(CASES) - 5)
    kept = read_dir(tmp_path / "data" / "mine" / "metadata")["caption"].to_pylist()
    assert kept == [c for _, _, c in CASES if c.startswith("scr")]
