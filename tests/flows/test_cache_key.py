"""A shard task's cache key: what makes a cached "done" stale."""

from __future__ import annotations

import dataclasses

from catalog import load_catalog
from flows.execution.stages import _cache_key
from tasks.curation import filter as filter_stage
from tasks.curation import views
from tasks.runtime.shards import bump_generation


def test_a_views_profile_and_the_sources_generation_are_in_the_key(tmp_path):
    # build-latents passes each view's fingerprint as the task's `inputs`: a profile edit must
    # be a cache miss, so that build_view runs and rebuilds the stale view.
    params = {"root": str(tmp_path), "stage": "views", "source": "laion", "shard": "laion-hq"}
    plain = _cache_key(None, params)
    assert plain.startswith("views-laion-laion-hq-v") and "-i" not in plain.rsplit("-g", 1)[1]
    catalog = load_catalog()
    stricter = dataclasses.replace(catalog.profile("laion-hq"), min_aesthetic=8.0)
    edited = dataclasses.replace(catalog, profiles={**catalog.profiles, "laion-hq": stricter})
    before = views.fingerprint(tmp_path, catalog, "laion-hq")
    after = views.fingerprint(tmp_path, edited, "laion-hq")
    assert before != after
    first = _cache_key(None, {**params, "inputs": before})
    assert first != plain and first.endswith(f"-i{before}")
    assert _cache_key(None, {**params, "inputs": after}) != first
    bump_generation(tmp_path, "laion")
    assert _cache_key(None, {**params, "inputs": before}) != first


def test_a_build_profiles_settings_are_in_the_filter_tasks_key(tmp_path):
    # build-latents passes the build profile's fingerprint to the filter and filter-pixels
    # tasks: an edit is a cache miss, so the stage runs and refuses the stale unit (see
    # tasks.curation.filter.check_profile) instead of a cached "done".
    catalog = load_catalog()
    broad = catalog.profile("laion-broad")
    assert filter_stage.profile_fingerprint(broad) == filter_stage.profile_fingerprint(
        dataclasses.replace(broad)
    )
    looser = dataclasses.replace(broad, min_aesthetic=6.0)
    assert filter_stage.profile_fingerprint(looser) != filter_stage.profile_fingerprint(broad)
    params = {"root": str(tmp_path), "stage": "filtered", "source": "laion", "shard": "all"}
    keys = {
        _cache_key(None, {**params, "inputs": filter_stage.profile_fingerprint(p)})
        for p in (broad, looser)
    }
    assert len(keys) == 2
