"""Every data stage, called directly, on a small demo mirror with planted faults.

The module fixture runs the chain once (metadata -> filter -> fetch -> score -> select ->
tokenize -> encode); the tests read what it left on disk, the way the trainer and the dashboard
do. The demo is scored by the tiny twins; its thresholds read the demo metadata's scores.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from catalog import buckets, load_catalog
from catalog.loader import PACKAGED_DIR
from sdtrain.atomic import TMP_MARK
from tasks.curation import filter as filter_stage
from tasks.curation import filter_pixels, score
from tasks.latents import encode, latent_keys, tokenize
from tasks.runtime.shards import read_stats, summarize
from tasks.sources import demo_source, fetch_images, metadata

STAGES = ("metadata", "filtered", "shards", "scores", "selected", "tokens", "latents")


def run_chain(root: Path, source, profile, model, scorer, spec: encode.LatentSpec) -> None:
    """The stages of build-latents, in order, as the flow calls them (minus Prefect); `spec`:
    the latent layout the flow takes from the catalog (`encode.spec_for`)."""
    for i, location in enumerate(metadata.list_metadata_files(root, source)):
        metadata.fetch_metadata_shard(root, source, i, location)
    filter_stage.filter_metadata(root, source.name, profile, source.samples_per_shard)
    shards = sorted(p.stem for p in (root / source.name / "filtered").glob("[0-9]*.parquet"))
    fetch = functools.partial(
        fetch_images.fetch_images_shard,
        root,
        source.name,
        image_size=source.resolution,
        min_side=profile.min_side,
        thread_count=4,
        allow_private_hosts=source.allow_private_hosts,
    )
    # Two shards at a time, as the flow's thread pool runs them.
    with (
        demo_source.serve_mirror(root / source.name / "mirror"),
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        list(pool.map(fetch, shards))
    for s in shards:
        score.score_shard(root, source.name, s, scorer, device="cpu")
    filter_pixels.select_pixels(root, source.name, profile, scored=True)
    for s in shards:
        tokenize.tokenize_shard(root, source.name, s)
    for s in shards:
        encode.encode_shard(root, source.name, s, model, spec=spec)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    catalog = load_catalog(PACKAGED_DIR)
    # 60 images + the planted rows leave 71 after the metadata filter: 3 fetch shards. Each
    # fetch starts img2dataset in fresh interpreters (~10 s of CPU), so shards are few.
    source = dataclasses.replace(
        catalog.source("demo"), options={"num_images": 60, "seed": 1}, samples_per_shard=24
    )
    root = tmp_path_factory.mktemp("data")
    profile, model = catalog.profile(source.profile), catalog.model(source.model)
    scorer = catalog.scorer(profile.scorer)
    spec = encode.spec_for(catalog, source.name)
    run_chain(root, source, profile, model, scorer, spec)
    shards = sorted(p.stem for p in (root / source.name / "filtered").glob("[0-9]*.parquet"))
    return SimpleNamespace(
        root=root,
        source=source,
        profile=profile,
        model=model,
        scorer=scorer,
        spec=spec,
        name=source.name,
        shards=shards,
        dir=root / source.name,
    )


def stage_summary(chain, stage: str) -> dict:
    return summarize(read_stats(chain.root, chain.name, stage))


def test_the_chain_ran_over_several_shards(chain):
    assert len(chain.shards) >= 3
    for stage in STAGES:
        expected = 1 if stage in ("metadata", "filtered", "selected") else len(chain.shards)
        assert stage_summary(chain, stage)["num_shards"] == expected, stage


def test_every_planted_fault_is_counted_under_its_reason(chain):
    dropped: dict[str, int] = {}
    for stage in STAGES:
        for reason, n in stage_summary(chain, stage)["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    assert dropped == demo_source.PLANTED


def test_every_metadata_row_is_kept_or_dropped(chain):
    summaries = [stage_summary(chain, stage) for stage in STAGES]
    num_rows = pq.read_metadata(chain.dir / "metadata" / "00000.parquet").num_rows
    num_dropped = sum(sum(s["dropped"].values()) for s in summaries)
    assert summaries[0]["num_in"] == num_rows
    assert summaries[-1]["num_out"] + num_dropped == num_rows
    # Each stage takes exactly what the one before it kept.
    for before, after in zip(summaries, summaries[1:], strict=False):
        assert after["num_in"] == before["num_out"]


def test_shards_are_webdataset_tars_of_the_successful_rows(chain):
    shapes = set()
    for shard in chain.shards:
        table = pq.read_table(chain.dir / "shards" / f"{shard}.parquet").to_pylist()
        success = [r for r in table if r["status"] == "success"]
        samples = list(
            wds.WebDataset(str(chain.dir / "shards" / f"{shard}.tar"), shardshuffle=False)
        )
        assert sorted(s["__key__"] for s in samples) == [r["key"] for r in success]
        captions = {r["key"]: r["caption"] for r in success}
        for sample in samples:
            key = sample["__key__"]
            assert sample["txt"].decode() == captions[key]
            meta = json.loads(sample["json"])
            assert meta["key"] == key
            # At most resolution² pixels, the aspect ratio of the original kept.
            image = Image.open(io.BytesIO(sample["jpg"]))
            side = chain.source.resolution
            assert image.size == buckets.stored_size(meta["width"], meta["height"], side)
            w, h = image.size
            shapes.add("square" if w == h else "landscape" if w > h else "portrait")
    assert shapes == {"square", "landscape", "portrait"}  # the demo exercises aspect buckets


def test_failed_rows_stay_in_the_sample_table_with_their_reason(chain):
    statuses: dict[str, int] = {}
    for shard in chain.shards:
        for status in pq.read_table(chain.dir / "shards" / f"{shard}.parquet")["status"]:
            statuses[status.as_py()] = statuses.get(status.as_py(), 0) + 1
    statuses.pop("success")
    planted = demo_source.PLANTED
    # too_small here: only the 2 images that declared a large size but are small.
    assert statuses == {
        "http_404": planted["http_404"],
        "decode_error": planted["decode_error"],
        "too_small": 2,
    }


def test_latents_are_fp16_rows_of_the_encoded_keys(chain):
    """The demo trains on aspect buckets with flips and a latent drawn per epoch
    (docs/training-data.md): per shard, a file per bucket [n, 2 views, 8 channels, h, w], and
    a keys file that places every encoded key once."""
    assert (chain.spec.legacy, chain.spec.views, chain.spec.channels) == (False, 2, 8)
    names = buckets.BucketPlan.from_dict(chain.model.buckets, chain.model.resolution).names()
    used: set[str] = set()
    for stats in read_stats(chain.root, chain.name, "latents"):
        written = latent_keys.read(chain.root, chain.name, stats.shard)
        keys = written["key"].to_pylist()
        assert not (chain.dir / "latents" / f"{stats.shard}.npy").exists()  # no legacy file
        assert latent_keys.spec(written) == chain.spec.to_dict() == stats.extra["latent_spec"]
        assert len(set(keys)) == len(keys) == stats.num_out
        token_keys = pq.read_table(chain.dir / "tokens" / f"{stats.shard}.parquet")["key"]
        token_rows = written["token_row"].to_numpy()
        assert token_keys.take(written["token_row"]).to_pylist() == keys
        assert (np.diff(token_rows) > 0).all()  # in token order
        # The image digests are the shard table's.
        shard = pq.read_table(chain.dir / "shards" / f"{stats.shard}.parquet")
        sha = dict(zip(shard["key"].to_pylist(), shard["sha256"].to_pylist(), strict=True))
        assert written["sha256"].to_pylist() == [sha[k] for k in keys]
        rows: dict[str, list[int]] = {}
        for bucket, row in zip(
            written["bucket"].to_pylist(), written["bucket_row"].to_pylist(), strict=True
        ):
            rows.setdefault(bucket, []).append(row)
        assert set(rows) <= set(names)
        assert stats.extra["buckets"] == {b: len(r) for b, r in rows.items()}
        for bucket, bucket_rows in rows.items():
            latents = np.load(latent_keys.latents_path(chain.root, chain.name, stats.shard, bucket))
            w, h = (int(v) for v in bucket.split("x"))
            assert latents.dtype == np.float16
            assert latents.shape == (len(bucket_rows), 2, 8, h // 8, w // 8)
            assert sorted(bucket_rows) == list(range(len(latents)))  # each row once
            assert np.isfinite(latents).all()
        assert sorted(
            p.name for p in chain.dir.joinpath("latents").glob(f"{stats.shard}.*.npy")
        ) == (sorted(f"{stats.shard}.{b}.npy" for b in rows))  # no file of a bucket without rows
        used |= set(rows)
        # The ids trainers memory-map: int32 [N, 77], row i = the parquet's row i.
        ids = np.load(chain.dir / "tokens" / f"{stats.shard}.npy", mmap_mode="r")
        assert ids.dtype == np.int32 and ids.shape == (len(token_keys), 77)
    assert used == set(names)  # wide, square and tall images: every bucket of the plan
    assert sum(s.num_out for s in read_stats(chain.root, chain.name, "latents")) > 0


def test_selected_samples_are_unique_images(chain):
    selected = [
        k
        for s in chain.shards
        for k in pq.read_table(chain.dir / "selected" / f"{s}.parquet")["key"].to_pylist()
    ]
    sha = {}
    for shard in chain.shards:
        table = pq.read_table(chain.dir / "shards" / f"{shard}.parquet")
        sha.update(zip(table["key"].to_pylist(), table["sha256"].to_pylist(), strict=True))
    assert len({sha[k] for k in selected}) == len(selected)


def test_rerun_skips_every_stage_and_rewrites_nothing(chain):
    def snapshot() -> dict[str, int]:
        return {
            str(p.relative_to(chain.root)): p.stat().st_mtime_ns
            for p in chain.root.rglob("*")
            if p.is_file()
        }

    before = snapshot()
    results = [
        metadata.fetch_metadata_shard(chain.root, chain.source, i, location)
        for i, location in enumerate(metadata.list_metadata_files(chain.root, chain.source))
    ]
    results.append(
        filter_stage.filter_metadata(
            chain.root, chain.name, chain.profile, chain.source.samples_per_shard
        )
    )
    # No server: a fetch that did not skip would fail every URL.
    results += [
        fetch_images.fetch_images_shard(
            chain.root,
            chain.name,
            s,
            image_size=chain.source.resolution,
            min_side=chain.profile.min_side,
        )
        for s in chain.shards
    ]
    results += [score.score_shard(chain.root, chain.name, s, chain.scorer) for s in chain.shards]
    results.append(filter_pixels.select_pixels(chain.root, chain.name, chain.profile, scored=True))
    results += [tokenize.tokenize_shard(chain.root, chain.name, s) for s in chain.shards]
    results += [
        encode.encode_shard(chain.root, chain.name, s, chain.model, spec=chain.spec)
        for s in chain.shards
    ]
    assert all(r.skipped for r in results), [r.stage for r in results if not r.skipped]
    assert snapshot() == before


def test_no_hidden_temporaries_remain(chain):
    assert [p for p in chain.root.rglob("*") if TMP_MARK in p.name] == []


def test_every_fetched_image_is_scored_and_the_waterfalls_add_up(chain):
    for shard in chain.shards:
        table = pq.read_table(chain.dir / "shards" / f"{shard}.parquet").to_pylist()
        fetched = sorted(r["key"] for r in table if r["status"] == "success")
        scored = pq.read_table(chain.dir / "scores" / f"{shard}.parquet")
        assert scored["key"].to_pylist() == fetched
        assert scored.schema.field("phash").type.bit_width == 64
    for stage in ("filtered", "selected"):
        report = json.loads((chain.dir / stage / "waterfall.json").read_text())
        removed = sum(s["removed"] for s in report["steps"])
        assert report["num_in"] - removed == report["num_out"]
        assert {s["rule"]: s["removed"] for s in report["steps"] if s["removed"]} == (
            stage_summary(chain, stage)["dropped"]
        )
        assert (chain.dir / stage / "gallery.html").exists()
