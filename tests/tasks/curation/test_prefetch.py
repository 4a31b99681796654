"""The semantic_prefetch switch (issue 35, item 4): the catalog refuses it on a source with no
published embeddings, and switching it on for a root built before keeps that root's selection
(the metadata filter's rows do not depend on it)."""

from __future__ import annotations

import pytest

from catalog import CatalogError, FilterProfile, load_catalog
from catalog.copies import copy_catalog, edit_entries
from tasks.curation import filter
from tasks.runtime.shards import ShardStats, write_record


def test_semantic_prefetch_needs_the_sources_embeddings(tmp_path):
    catalog = copy_catalog(tmp_path / "catalog")
    with edit_entries(catalog / "profiles.yaml") as profiles:
        profiles["laion-broad"]["semantic_prefetch"] = True
    with pytest.raises(CatalogError, match=r"laion: .*semantic_prefetch.*embeddings"):
        load_catalog(catalog)
    with edit_entries(catalog / "sources.yaml") as sources:
        sources["laion"]["options"] = {"embeddings": str(tmp_path / "laion2B-en")}
    assert load_catalog(catalog).profile("laion-broad").semantic_prefetch


def test_switching_prefetch_on_keeps_a_built_roots_filter(tmp_path):
    built = FilterProfile(name="p", min_aesthetic=5.0)
    stats = ShardStats(stage="filtered", source="s", shard=filter.ALL)
    stats.extra = {"profile_settings": filter.profile_settings(built)}
    record = tmp_path / "s" / "filtered" / f"{filter.ALL}.stats.json"
    record.parent.mkdir(parents=True)
    write_record(record, stats)
    switched = FilterProfile(name="p", min_aesthetic=5.0, semantic_prefetch=True)
    filter.check_profile(tmp_path, "s", "filtered", switched)  # no ProfileChanged
    with pytest.raises(filter.ProfileChanged):
        filter.check_profile(tmp_path, "s", "filtered", FilterProfile(name="p", min_aesthetic=6))
