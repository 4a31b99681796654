"""Catalog entries of curation: profiles' dedup levels and thresholds, scoring models, and the
datasets that are views over a source's build profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from catalog import CatalogError, load_catalog
from catalog.loader import PACKAGED_DIR
from tests.catalog.test_catalog import edit_entry


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def error(directory: Path) -> str:
    with pytest.raises(CatalogError) as info:
        load_catalog(directory)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_shipped_scorers_and_which_profiles_are_scored():
    catalog = load_catalog(PACKAGED_DIR)
    assert sorted(catalog.scorers) == ["laion-scoring", "tiny-scoring"]
    assert catalog.scorer("tiny-scoring").random_weights
    assert not catalog.scorer("laion-scoring").random_weights
    assert "laion-scoring" not in catalog.models  # scoring entries are not SD models
    # LAION ships its scores; the archive sources are scored from their pixels.
    assert catalog.profile("laion-broad").scorer == ""
    for source in ("diffusiondb", "journeydb", "vggface2", "coco", "local"):
        assert catalog.profile(catalog.source(source).profile).scorer == "laion-scoring"


def test_laion_is_built_once_at_broad_and_hq_is_a_view_over_it():
    catalog = load_catalog(PACKAGED_DIR)
    assert catalog.source("laion").profile == "laion-broad"
    assert {catalog.dataset(d).source for d in ("laion-broad", "laion-hq")} == {"laion"}
    broad, hq = catalog.profile("laion-broad"), catalog.profile("laion-hq")
    assert (hq.min_aesthetic, hq.min_similarity, hq.max_pwatermark) == (7.5, 0.30, 0.15)
    assert hq.min_aesthetic >= broad.min_aesthetic and hq.min_similarity >= broad.min_similarity


def test_unknown_dedup_level_lists_the_levels(catalog_copy):
    append(catalog_copy / "profiles.yaml", "typo:\n  dedup: [sha256, phahs]\n")
    message = error(catalog_copy)
    assert "profiles.yaml" in message and "typo.dedup" in message and "'phahs'" in message
    assert "url, sha256, phash, semantic" in message


def test_threshold_outside_the_score_range(catalog_copy):
    append(catalog_copy / "profiles.yaml", "bad:\n  max_punsafe: 5\n")
    assert "bad.max_punsafe: must be within [0.0, 1.0]" in error(catalog_copy)


def test_profile_naming_an_unknown_scorer(catalog_copy):
    append(catalog_copy / "profiles.yaml", "bad:\n  scorer: laion-scorer\n")
    message = error(catalog_copy)
    assert "bad.scorer" in message and "'laion-scorer'" in message and "laion-scoring" in message


def test_real_scorer_must_name_every_weights_file(catalog_copy):
    append(catalog_copy / "models.yaml", "half:\n  kind: scoring\n  embed_weights: a.bin\n")
    message = error(catalog_copy)
    assert "models.yaml" in message and "half.similarity_weights" in message


def test_semantic_visits_is_a_profile_setting(catalog_copy):
    """Issue 26: the nearest other clusters semantic dedup visits; 2 unless set, never < 0."""
    assert load_catalog(catalog_copy).profile("laion-hq").semantic_visits == 2
    path = catalog_copy / "profiles.yaml"
    edit_entry(path, "laion-hq", "  min_side: 512\n", "  min_side: 512\n  semantic_visits: 8\n")
    assert load_catalog(catalog_copy).profile("laion-hq").semantic_visits == 8
    edit_entry(path, "laion-hq", "  semantic_visits: 8\n", "  semantic_visits: -1\n")
    with pytest.raises(CatalogError, match=r"laion-hq\.semantic_visits: must be >= 0"):
        load_catalog(catalog_copy)
