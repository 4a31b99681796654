"""Catalog settings of issue 20's captions: seed 002's score settings on a profile, and a
phase's train-time caption settings; a bad value fails in one line naming entry and field."""

from __future__ import annotations

import pytest

from catalog import CatalogError, load_catalog
from tests.catalog.test_catalog import edit_entry

SEED_002_YAML = """seed002:
  exclude_tags: [animated]
  tag_separator: ' '
  abs_min_score: 50
  min_score: 200
  score_tags: [ 3200, 1600, 800, 600, 400, 300, 200, 150, 100, 50, 25, 5 ]
  tag_bonus_scores:
    solo: 100
    pride flag: 50
    monochrome: -75
"""


def test_the_seed_002_profile_loads_from_yaml(catalog_copy):
    path = catalog_copy / "profiles.yaml"
    path.write_text(path.read_text() + SEED_002_YAML)
    profile = load_catalog(catalog_copy).profile("seed002")
    assert profile.score_tags[:3] == (3200.0, 1600.0, 800.0) and profile.abs_min_score == 50.0
    assert profile.tag_bonus_scores == {"solo": 100, "pride flag": 50, "monochrome": -75}


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        ("[ 3200, 1600,", "[ 1600, 3200,", r"seed002\.score_tags: thresholds highest first"),
        ("solo: 100", "solo: lots", r"seed002\.tag_bonus_scores\.solo: expected a number"),
        ("abs_min_score: 50", "abs_min_score: high", r"seed002\.abs_min_score: expected a number"),
    ],
)
def test_bad_score_settings_name_the_profile_and_field(catalog_copy, old, new, error):
    path = catalog_copy / "profiles.yaml"
    path.write_text(path.read_text() + SEED_002_YAML)
    edit_entry(path, "seed002", old, new)
    with pytest.raises(CatalogError, match=error):
        load_catalog(catalog_copy)
