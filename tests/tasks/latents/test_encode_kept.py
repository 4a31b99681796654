"""Issue 33, item 5: any rewrite of a shard that phase sets link (a refetch, a re-selection, a
spec left and returned to) keeps their files aside, never over an earlier kept generation, so
those phases resume on what they mixed; `sdpipe prune-latents` also finds the bucket files an
old bucket plan left in `latents/`."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from catalog import Catalog, Dataset, FilterProfile, MixEntry, Model, Source, load_catalog
from catalog.loader import PACKAGED_DIR
from sdtrain.data import PhaseSet
from tasks.curation import views as views_stage
from tasks.latents import encode, kept_latents, latent_keys, tokenize
from tasks.phases import mix
from tasks.sources.fetch_images import invalidate_downstream
from tests.tasks.latents.test_encode import SOURCE, texture
from tests.tasks.latents.test_encode_buckets import (
    PLAN,
    SHARD,
    STORED,
    image_bytes,
    make_shard,
    spec_of,
    token_order,
)
from tests.tasks.phases.test_mix import phase


@pytest.fixture(scope="module")
def stored() -> dict[str, bytes]:
    rng = np.random.default_rng(5)
    return {k: image_bytes(texture(rng, w, h), fmt) for k, (w, h, fmt) in STORED.items()}


@pytest.fixture(scope="module")
def bucketed():
    return dataclasses.replace(load_catalog(PACKAGED_DIR).model("tiny"), buckets=PLAN)


PLAN_B = {"area": 64 * 64, "step": 8, "min_side": 40, "max_side": 96, "max_aspect": 1.5}


@pytest.fixture
def catalog(tmp_path, monkeypatch) -> Catalog:
    """One dataset over SOURCE; its view is every key encoded now."""

    def view(root, catalog, dataset):
        keys = latent_keys.read(root, SOURCE, SHARD)["key"]
        yield pa.table({"shard": [SHARD] * len(keys), "key": keys})

    monkeypatch.setattr(views_stage, "view_key_groups", view)
    return Catalog(
        sources={SOURCE: Source(name=SOURCE, kind="url", location="x", license="x", profile="p")},
        profiles={"p": FilterProfile(name="p")},
        datasets={SOURCE: Dataset(name=SOURCE, source=SOURCE, profile="p")},
        phases={},
        models={"m": Model(name="m", resolution=512, unet_config={"x": 1})},
        directory=tmp_path,
    )


def mixed(
    root: Path, catalog: Catalog, name: str, count: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Phase `name` mixed (`count` rows) from the files there now and started (a checkpoint):
    its rows."""
    p = phase(MixEntry(dataset=SOURCE, count=count), seed=1, name=name)
    assert not mix.phase_set_for_run(root, catalog, p)["reused"]
    (root / "runs" / name / "checkpoints" / "step-000002").mkdir(parents=True)
    return rows(root, catalog, name, count)


def rows(
    root: Path, catalog: Catalog, name: str, count: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The phase's rows as a resume reads them: its set reused (checked against its sources)."""
    p = phase(MixEntry(dataset=SOURCE, count=count), seed=1, name=name)
    assert mix.phase_set_for_run(root, catalog, p)["reused"]
    data = PhaseSet(root / "phases" / name)
    return [data[i][:2] for i in range(len(data))]


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for (za, ta), (zb, tb) in zip(a, b, strict=True):
        assert torch.equal(za, zb) and torch.equal(ta, tb)


def fetch(root: Path, stored: dict[str, bytes], keys: list[str]) -> None:
    """The shard as fetch leaves it with `keys` fetched (a refetch adds some): its tar, and
    the selection tokenize reads (a caption per key); the tokens are tokenize's to write."""
    scratch = root / "scratch"
    make_shard(scratch, {k: stored[k] for k in keys})
    (root / SOURCE / "shards").mkdir(parents=True, exist_ok=True)
    os.replace(
        scratch / SOURCE / "shards" / f"{SHARD}.tar", root / SOURCE / "shards" / f"{SHARD}.tar"
    )
    selected = root / SOURCE / "selected"
    selected.mkdir(parents=True, exist_ok=True)
    order = [k for k in token_order() if k in keys or k not in stored]
    pq.write_table(
        pa.table({"key": order, "caption": [f"a photo of {k}" for k in order]}),
        selected / f"{SHARD}.parquet",
    )


def build(root: Path, model, spec) -> None:
    tokenize.tokenize_shard(root, SOURCE, SHARD)
    encode.encode_shard(root, SOURCE, SHARD, model, batch_size=4, spec=spec)


def test_a_refetch_keeps_what_phase_sets_link_and_never_overwrites_a_kept_generation(
    tmp_path, stored, bucketed, catalog
):
    spec = spec_of(bucketed)
    first = [k for k in stored if k not in ("wide2", "tall2")]
    fetch(tmp_path, stored, first)
    build(tmp_path, bucketed, spec)
    p1 = mixed(tmp_path, catalog, "p1")

    # A refetch brings "wide2": the shard's records are removed and it is built again.
    fetch(tmp_path, stored, [*first, "wide2"])
    invalidate_downstream(tmp_path, SOURCE, SHARD)
    build(tmp_path, bucketed, spec)
    assert "wide2" in latent_keys.read(tmp_path, SOURCE, SHARD)["key"].to_pylist()
    assert_same(rows(tmp_path, catalog, "p1"), p1)  # p1 resumes on what it mixed
    latents, tokens = tmp_path / SOURCE / "latents", tmp_path / SOURCE / "tokens"
    assert (latents / f"spec-{spec.digest()}" / f"{SHARD}.keys.arrow").is_file()
    assert (tokens / "kept" / f"{SHARD}.parquet").is_file()

    # p2 mixes the refetched files; a second refetch keeps them in a new folder, not over p1's.
    p2 = mixed(tmp_path, catalog, "p2")
    fetch(tmp_path, stored, [*first, "wide2", "tall2"])
    invalidate_downstream(tmp_path, SOURCE, SHARD)
    build(tmp_path, bucketed, spec)
    assert_same(rows(tmp_path, catalog, "p1"), p1)
    assert_same(rows(tmp_path, catalog, "p2"), p2)
    assert (latents / f"spec-{spec.digest()}.2" / f"{SHARD}.keys.arrow").is_file()
    assert (tokens / "kept.2" / f"{SHARD}.parquet").is_file()

    # Once no set links them, prune takes every kept generation.
    for name in ("p1", "p2"):
        shutil.rmtree(tmp_path / "phases" / name)
    pruned = kept_latents.prune(tmp_path, delete=True)["files"]
    assert {f.parent.name for f, _ in pruned} == {
        f"spec-{spec.digest()}",
        f"spec-{spec.digest()}.2",
        "kept",
        "kept.2",
    }


def test_a_spec_left_and_returned_to_keeps_each_generation(tmp_path, stored, bucketed, catalog):
    plain, flipped = spec_of(bucketed), spec_of(bucketed, flips=True)
    make_shard(tmp_path, stored)
    encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=plain)
    p1 = mixed(tmp_path, catalog, "p1")
    # The shard's rows under plain come back in another order: what p1 must not read.
    fetch(tmp_path, stored, list(stored)[::-1])
    invalidate_downstream(tmp_path, SOURCE, SHARD)
    build(tmp_path, bucketed, flipped)
    p2 = mixed(tmp_path, catalog, "p2")
    encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=plain)
    p3 = mixed(tmp_path, catalog, "p3")
    encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=flipped)
    for name, before in (("p1", p1), ("p2", p2), ("p3", p3)):
        assert_same(rows(tmp_path, catalog, name), before)
    latents = tmp_path / SOURCE / "latents"
    assert sorted(p.name for p in latents.glob("spec-*")) == sorted(
        [f"spec-{plain.digest()}", f"spec-{plain.digest()}.2", f"spec-{flipped.digest()}"]
    )


def test_an_old_bucket_plans_files_are_not_left_behind_and_prune_finds_those_that_were(
    tmp_path, stored, bucketed, catalog, capsys
):
    from flows.cli import main

    plan_b = dataclasses.replace(bucketed, buckets=PLAN_B)
    assert spec_of(plan_b).plan.names() != spec_of(bucketed).plan.names()
    make_shard(tmp_path, stored)
    encode.encode_shard(tmp_path, SOURCE, SHARD, bucketed, batch_size=4, spec=spec_of(bucketed))
    p1 = mixed(tmp_path, catalog, "p1", count=1)  # links one of the old plan's bucket files
    record = encode.encode_shard(
        tmp_path, SOURCE, SHARD, plan_b, batch_size=4, spec=spec_of(plan_b)
    )
    latents = tmp_path / SOURCE / "latents"
    assert sorted(p.name for p in latents.glob("*.npy")) == sorted(
        f"{SHARD}.{b}.npy" for b in record.extra["buckets"]
    ), "the old plan's unlinked bucket files were left in latents/"

    # What an older sdpipe left there (older than the shard's record) is listed, then deleted;
    # a file newer than the record (an encode at work) is not.
    stale, fresh = latents / f"{SHARD}.48x80.npy", latents / f"{SHARD}.16x16.npy"
    np.save(stale, np.zeros((1, 1, 4, 10, 6), np.float16))
    np.save(fresh, np.zeros((1, 1, 4, 2, 2), np.float16))
    written = (latents / f"{SHARD}.stats.json").stat().st_mtime_ns
    os.utime(stale, ns=(written - 10**9, written - 10**9))
    os.utime(fresh, ns=(written + 10**9, written + 10**9))
    assert main(["--data-root", str(tmp_path), "prune-latents"]) == 0
    listed = capsys.readouterr().out
    assert str(stale) in listed and str(fresh) not in listed
    assert main(["--data-root", str(tmp_path), "prune-latents", "--yes"]) == 0
    assert not stale.exists() and fresh.exists()
    assert encode.shard_done(tmp_path, SOURCE, SHARD, spec_of(plan_b))
    assert_same(rows(tmp_path, catalog, "p1", count=1), p1)  # p1's kept files stay: linked
