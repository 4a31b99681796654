"""Datasets as views: a stricter dataset is a query over what its source was built at (never a
second download), materialized as a key list with its waterfall, refreshed when its profile
changes, and the set mix draws from."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

import pyarrow.parquet as pq

from catalog import Catalog, Dataset, FilterProfile, Source
from sdtrain.atomic import write_json_atomic
from tasks.curation import filter_pixels, views
from tasks.curation.waterfall import Waterfall
from tasks.phases import mix
from tasks.runtime.shards import ShardStats, stats_path

BROAD = FilterProfile(name="broad", min_aesthetic=5.0, min_side=256, dedup=("sha256",))
HQ = FilterProfile(name="hq", min_aesthetic=6.0, max_pwatermark=0.2, min_side=256, dedup=())
OPEN = FilterProfile(name="open", dedup=())


def make_catalog(tmp_path, hq: FilterProfile = HQ) -> Catalog:
    src = Source(name="src", kind="url", location="x", license="x", profile="broad")
    profiles = {p.name: p for p in (BROAD, hq, OPEN)}
    datasets = {
        name: Dataset(name=name, source="src", profile=profile)
        for name, profile in (("src-broad", "broad"), ("src-hq", "hq"), ("src-all", "open"))
    }
    return Catalog(
        sources={"src": src},
        profiles=profiles,
        datasets=datasets,
        phases={},
        models={},
        directory=tmp_path,
    )


def built_source(fetched, scene, root) -> None:
    """A source fetched and selected at `broad`: k0..k5 with their metadata scores."""
    scores = {  # key: (aesthetic, pwatermark, side)
        "k0": (7.0, 0.1, 512),
        "k1": (6.5, 0.5, 512),  # watermark too likely for hq
        "k2": (5.5, 0.1, 512),  # broad, not hq
        "k3": (4.0, 0.1, 512),  # not even broad: never selected
        "k4": (8.0, 0.1, 128),  # too small for both
        "k5": (7.5, 0.05, 300),
    }
    rows = [
        {
            "key": key,
            "caption": f"scene {key}",
            "width": side,
            "height": side,
            "aesthetic": aesthetic,
            "pwatermark": pwatermark,
            "image": scene(i),
        }
        for i, (key, (aesthetic, pwatermark, side)) in enumerate(scores.items())
    ]
    fetched(root, "src", rows)
    filter_pixels.select_pixels(root, "src", BROAD)


def test_a_stricter_view_is_a_query_over_the_source_selection(fetched, scene, tmp_path):
    built_source(fetched, scene, tmp_path)
    catalog = make_catalog(tmp_path)
    assert views.view_keys(tmp_path, catalog, "src-hq")["key"].to_pylist() == ["k0", "k5"]
    assert views.view_keys(tmp_path, catalog, "src-broad")["key"].to_pylist() == [
        "k0", "k1", "k2", "k5",
    ]  # fmt: skip
    # A looser view cannot bring back what the build profile removed: nothing is refetched.
    assert views.view_keys(tmp_path, catalog, "src-all")["key"].to_pylist() == [
        "k0", "k1", "k2", "k5",
    ]  # fmt: skip
    wf = Waterfall.read(views.view_paths(tmp_path, "src", "src-hq")["waterfall"])
    assert (wf.num_in, wf.num_out, wf.dropped) == (4, 2, {"aesthetic": 1, "pwatermark": 1})
    assert views.view_paths(tmp_path, "src", "src-hq")["gallery"].exists()


def test_a_view_is_rebuilt_when_its_profile_changes(fetched, scene, tmp_path):
    built_source(fetched, scene, tmp_path)
    assert views.view_keys(tmp_path, make_catalog(tmp_path), "src-hq")["key"].to_pylist() == [
        "k0", "k5",
    ]  # fmt: skip
    stricter = dataclasses.replace(HQ, min_aesthetic=7.2)
    catalog = make_catalog(tmp_path, hq=stricter)
    assert views.view_keys(tmp_path, catalog, "src-hq")["key"].to_pylist() == ["k5"]
    assert views.build_view(tmp_path, catalog, "src-hq").skipped  # fresh: not redone


def test_mix_draws_from_the_view_and_what_was_encoded(fetched, scene, tmp_path):
    built_source(fetched, scene, tmp_path)
    # k5 was selected but (say) failed to decode in encode: it cannot be drawn.
    encoded = ["k0", "k1", "k2"]
    record = ShardStats(stage="latents", source="src", shard="00000", num_in=3, num_out=3)
    record.extra = {"keys": encoded, "token_rows": [0, 1, 2]}
    write_json_atomic(stats_path(tmp_path, "src", "latents", "00000"), asdict(record))
    view = mix.dataset_view(tmp_path, make_catalog(tmp_path), "src-hq")
    assert view["key"].to_pylist() == ["k0"]
    assert view["dataset"].to_pylist() == ["src-hq"]
    assert pq.read_table(views.view_paths(tmp_path, "src", "src-hq")["keys"]).num_rows == 2
