"""Semantic dedup before fetch (issue 35, item 4): build-latents on the demo source (a URL source
served on loopback, LAION's columns and `hash`) with `semantic_prefetch` on and a LAION-layout
embeddings folder (img_emb/img_emb_NNNN.npy + metadata/metadata_NNNN.parquet): the planted
near-duplicates at other URLs are never requested, rows without an embedding are fetched and
counted, and a rerun changes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog.copies import edit_entries
from tasks.runtime.shards import ShardStats, read_stats, stats_path
from tasks.sources import demo_source
from tests.conftest import DEMO_IMAGES, write_small_catalog

pytestmark = pytest.mark.slow


def laion_embeddings(folder: Path, mirror: Path) -> dict:
    """LAION's layout for the mirror's rows, in two parts, with random fp16 768-d vectors:
    three rows copy another's vector (noise far under the threshold), two rows have none and
    one row's entry carries another `hash` (so it joins to nothing). Returns the URL sets."""
    rows = pq.read_table(sorted((mirror / "metadata").glob("*.parquet"))[0]).to_pylist()
    rng = np.random.default_rng(7)
    emb = rng.standard_normal((len(rows), 768)).astype(np.float32)
    copies = {3: 0, 8: 5, 13: 10, 30: 31, 40: 41}  # copy -> original
    for copy, original in copies.items():
        emb[copy] = emb[original] + 1e-3 * rng.standard_normal(768)
    missing, other_hash = {20, 21}, 22
    meta = []
    for i, r in enumerate(rows):
        h = r["hash"] + 1 if i == other_hash else r["hash"]
        meta.append({"url": r["URL"], "caption": r["TEXT"], "hash": h, "i": i})
    keep = [m for m in meta if m["i"] not in missing]
    (folder / "img_emb").mkdir(parents=True)
    (folder / "metadata").mkdir()
    half = len(keep) // 2
    for p, part in enumerate((keep[:half], keep[half:])):
        pq.write_table(
            pa.Table.from_pylist([{k: m[k] for k in ("url", "caption", "hash")} for m in part]),
            folder / "metadata" / f"metadata_{p:04d}.parquet",
        )
        np.save(
            folder / "img_emb" / f"img_emb_{p:04d}.npy",
            emb[[m["i"] for m in part]].astype(np.float16),
        )
    url = [r["URL"] for r in rows]
    return {
        "copies": {url[c]: url[o] for c, o in copies.items()},
        "no_embedding": {url[i] for i in (*missing, other_hash)},
    }


def test_duplicates_found_on_published_embeddings_are_never_fetched(
    prefect_stack, tmp_path, monkeypatch
):
    from prefect.logging.handlers import APILogWorker

    from flows.build_latents import build_latents

    root = tmp_path / "data"
    mirror = demo_source.generate_mirror(root / "demo" / "mirror", num_images=DEMO_IMAGES, seed=1)
    urls = laion_embeddings(tmp_path / "laion2B-en", mirror)
    catalog = write_small_catalog(tmp_path / "catalog")
    with edit_entries(catalog / "sources.yaml") as sources:
        sources["demo"]["options"]["embeddings"] = str(tmp_path / "laion2B-en")
    with edit_entries(catalog / "profiles.yaml") as profiles:
        profiles["demo"]["semantic_prefetch"] = True
    monkeypatch.setenv("SDPIPE_CATALOG", str(catalog))
    requested: list[str] = []
    monkeypatch.setattr(
        demo_source._QuietHandler, "log_message", lambda self, *a: requested.append(self.path)
    )

    def build() -> ShardStats:
        state = build_latents(source="demo", data_root=str(root), workers=2, return_state=True)
        APILogWorker.drain_all()
        assert state.is_completed(), state.message
        return ShardStats.read(stats_path(root, "demo", "prefetch", "all"))

    first = build()
    base = next(iter(urls["copies"])).rsplit("/", 2)[0]
    fetched = {base + p for p in requested}
    filtered = pq.read_table(sorted((root / "demo" / "filtered").glob("[0-9]*.parquet")))
    passed = set(filtered["url"].to_pylist())
    pairs = [{c, o} for c, o in urls["copies"].items() if {c, o} <= passed]
    assert pairs, "no planted pair passed the metadata filter"
    dropped = pq.read_table(sorted((root / "demo" / "prefetch" / "dropped").glob("*.parquet")))
    by_key = dict(zip(filtered["key"].to_pylist(), filtered["url"].to_pylist(), strict=True))
    lost = {by_key[k] for k in dropped["key"].to_pylist()}
    # Of each planted pair one is dropped (the survivor rule's choice), and never requested.
    assert all(len(pair & lost) == 1 for pair in pairs) and len(lost) == len(pairs)
    assert not lost & fetched, "a duplicate found before fetch was fetched"
    assert urls["no_embedding"] & passed <= fetched  # kept and fetched, not dropped
    assert first.dropped == {"semantic_prefetch": len(pairs)}
    assert first.num_in == filtered.num_rows
    assert first.num_out == filtered.num_rows - len(pairs)
    assert first.extra["no_embedding"] == len(urls["no_embedding"] & passed)
    fetch = read_stats(root, "demo", "shards")
    assert sum(s.num_in for s in fetch) == first.num_out
    # The joined embeddings, one file per filtered shard (the layout score's shards have).
    embedded = pq.read_table(sorted((root / "demo" / "prefetch" / "embeddings").glob("*.parquet")))
    assert embedded.num_rows == filtered.num_rows - first.extra["no_embedding"]

    requested.clear()
    record = stats_path(root, "demo", "prefetch", "all")
    mtime = record.stat().st_mtime_ns
    again = build()
    assert record.stat().st_mtime_ns == mtime and again.dropped == first.dropped
    assert not requested  # nothing fetched again

    # A takedown after the build reaches what the prefetch step wrote (issue 36): a kept row's
    # joined embedding and a dropped row's entry in the dropped list are gone with the rest.
    from catalog import load_catalog
    from tasks.removal import apply, lists

    kept_key = embedded["key"].to_pylist()[0]
    dropped_key = dropped["key"].to_pylist()[0]
    takedown = tmp_path / "takedown.txt"
    takedown.write_text(f"{by_key[kept_key]}\n{by_key[dropped_key]}\n")
    profile = load_catalog().profile("demo")
    apply.remove(root, "demo", lists.read_list(takedown), profile, scored=True)
    prefetch = root / "demo" / "prefetch"
    for folder in ("embeddings", "dropped"):
        left = pq.read_table(sorted((prefetch / folder).glob("*.parquet")))["key"].to_pylist()
        assert kept_key not in left and dropped_key not in left, folder
