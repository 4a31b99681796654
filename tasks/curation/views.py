"""views: a dataset is a query over its source, materialized as the key list of what it keeps.

A source is fetched, scored and deduplicated once, at its own (loosest) profile; a dataset's
view applies its profile to that selection (`laion-hq` is a query over what `laion-broad`
fetched, never a second download), and is rebuilt when either profile or the selection changes.
The list holds (shard, key), sorted: mix joins it with the encoded keys a shard at a time, so
each hash table is one shard's (a 100M-key join is 10,000 small ones that stay in cache).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from catalog import Catalog
from sdtrain.atomic import atomic_path
from tasks.curation import filter as filter_stage
from tasks.curation import filter_pixels
from tasks.runtime.shards import ShardStats, run_shard, stats_path

STAGE = "views"
# The key file's layout, part of the fingerprint: views written before it held (shard, key)
# are rebuilt.
LAYOUT = 2


def view_paths(root: Path, source: str, dataset: str) -> dict[str, Path]:
    d = root / source / STAGE
    return {
        "keys": d / f"{dataset}.parquet",
        "waterfall": d / f"{dataset}.waterfall.json",
        "gallery": d / f"{dataset}.gallery.html",
    }


def fingerprint(root: Path, catalog: Catalog, dataset: str) -> str:
    """What a view depends on: its profile, its source's build profile and selection record."""
    ds = catalog.dataset(dataset)
    build = catalog.profile(catalog.source(ds.source).profile)
    selected = stats_path(root, ds.source, "selected", filter_stage.ALL)
    parts = {
        "profile": asdict(catalog.profile(ds.profile)),
        "build_profile": asdict(build),
        "selected": selected.read_text() if selected.exists() else "",
        "layout": LAYOUT,
    }
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def build_view(root: Path, catalog: Catalog, dataset: str) -> ShardStats:
    """Materialize one dataset's view: `views/<dataset>.parquet` (shard, key sorted), waterfall,
    gallery."""
    ds = catalog.dataset(dataset)
    profile = catalog.profile(ds.profile)
    scored = bool(catalog.profile(catalog.source(ds.source).profile).scorer)
    current = fingerprint(root, catalog, dataset)
    record = stats_path(root, ds.source, STAGE, dataset)
    if record.exists() and ShardStats.read(record).extra.get("fingerprint") != current:
        record.unlink()  # stale: its profile or the source's selection changed
    paths = view_paths(root, ds.source, dataset)

    def work(stats: ShardStats) -> None:
        con = filter_stage.connect(root)
        filter_pixels.pixel_rows(con, root, ds.source, profile, scored=scored, selected_only=True)
        wf = filter_stage.judge(
            con,
            profile,
            "pixels",
            label=f"view {dataset}",
            scores_dir=root / ds.source / "scores" if scored else None,
        )
        columns = {row[0] for row in con.sql("DESCRIBE passing").fetchall()}
        shard = (  # the fetch shard a row was read from: shards/NNNNN.parquet
            "parse_filename(filename, true)" if "filename" in columns else "NULL::VARCHAR"
        )
        keys = filter_stage.to_arrow(
            con.sql(
                f"SELECT {shard} AS shard, key FROM passing WHERE reason IS NULL "
                "ORDER BY shard, key"
            )
        )
        with atomic_path(paths["keys"]) as tmp:
            pq.write_table(keys, tmp)
        filter_stage.record(stats, wf)
        stats.extra = {"fingerprint": current, "profile": profile.name, "dataset": dataset}
        stats.extra |= wf.notes
        wf.write(paths["waterfall"], paths["gallery"])

    return run_shard(root, ds.source, STAGE, dataset, work)


def view_key_groups(root: Path, catalog: Catalog, dataset: str) -> Iterator[pa.Table]:
    """A dataset's kept keys a row group (~1M rows) at a time, as mix streams them (shard as a
    dictionary column, key), materializing (or refreshing) its view first."""
    ds = catalog.dataset(dataset)
    build_view(root, catalog, dataset)
    keys = pq.ParquetFile(view_paths(root, ds.source, dataset)["keys"], read_dictionary=["shard"])
    for i in range(keys.num_row_groups):
        yield keys.read_row_group(i)


def view_keys(root: Path, catalog: Catalog, dataset: str) -> pa.Table:
    """A dataset's kept keys (shard as a dictionary column, key), materializing (or refreshing)
    its view first."""
    ds = catalog.dataset(dataset)
    build_view(root, catalog, dataset)
    keys = pq.ParquetFile(view_paths(root, ds.source, dataset)["keys"], read_dictionary=["shard"])
    return keys.read()
