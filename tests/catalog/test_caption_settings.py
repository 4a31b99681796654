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


TAGGED_PHASE = """  train_time_captions: true
  shuffle_tags_p: 0.5
  keep_tokens: 1
  tag_separator: ' '
  tag_dropout: 0.1
"""


def tag_demo(path):
    """The demo phase (train-time captions on already) with seed 002's tag settings."""
    edit_entry(path, "demo", "  train_time_captions: true\n", "")
    edit_entry(path, "demo", "  grad_accum: 1\n", "  grad_accum: 1\n" + TAGGED_PHASE)


def test_a_phase_with_train_time_captions_reaches_the_run_config(catalog_copy):
    from sdtrain.config import run_config_for_phase

    path = catalog_copy / "phases.yaml"
    tag_demo(path)
    phase = load_catalog(catalog_copy).phase("demo")
    config = run_config_for_phase(phase, phase_dir="p", run_dir="r")
    settings = ("train_time_captions", "shuffle_tags_p", "keep_tokens", "tag_separator")
    assert [getattr(config, f) for f in settings] == [True, 0.5, 1, " "]
    assert config.tag_dropout == 0.1
    # A phase without them runs as before: stored ids, no augmentation.
    plain = run_config_for_phase(
        load_catalog(catalog_copy).phase("phase-1"), phase_dir="p", run_dir="r"
    )
    assert (plain.train_time_captions, plain.shuffle_tags_p, plain.tag_separator) == (
        False,
        0.0,
        ", ",
    )


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        ("  train_time_captions: true\n", "", r"demo\.shuffle_tags_p: caption augmentation needs "),
        (
            "  shuffle_tags_p: 0.5\n",
            "  shuffle_tags_p: 1.5\n",
            r"demo\.shuffle_tags_p: must be within",
        ),
        ("  tag_dropout: 0.1\n", "  tag_dropout: -0.1\n", r"demo\.tag_dropout: must be within"),
        ("  keep_tokens: 1\n", "  keep_tokens: -1\n", r"demo\.keep_tokens: must be >= 0"),
        ("  tag_separator: ' '\n", "  tag_separator: ''\n", r"demo\.tag_separator: must not be"),
    ],
)
def test_bad_caption_settings_name_the_phase_and_field(catalog_copy, old, new, error):
    path = catalog_copy / "phases.yaml"
    tag_demo(path)
    edit_entry(path, "demo", old, new)
    with pytest.raises(CatalogError, match=error):
        load_catalog(catalog_copy)


def test_keep_tokens_alone_needs_train_time_captions(catalog_copy):
    path = catalog_copy / "phases.yaml"
    edit_entry(path, "demo", "  train_time_captions: true\n", "")
    edit_entry(path, "demo", "  grad_accum: 1\n", "  grad_accum: 1\n  keep_tokens: 1\n")
    with pytest.raises(CatalogError, match=r"demo\.keep_tokens: caption augmentation needs"):
        load_catalog(catalog_copy)
