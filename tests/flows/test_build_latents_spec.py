"""build-latents encodes the layout the catalog asks for (docs/training-data.md, "Latents on
disk"): a model's bucket plan and a phase's flips give per-bucket files of two views; going back
to the legacy catalog re-encodes every shard, though the earlier run's tasks are cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from tasks.latents import encode, latent_keys
from tasks.runtime.shards import read_stats
from tests.conftest import write_small_catalog

pytestmark = pytest.mark.slow

PLAN = {"area": 64 * 64, "step": 16, "min_side": 32, "max_side": 128, "max_aspect": 2}


def _catalog(dest: Path, *, buckets: dict | None, flip_p: float, latent_sampling: bool) -> Path:
    catalog = write_small_catalog(dest)
    models = yaml.safe_load((catalog / "models.yaml").read_text())
    models["tiny"].pop("buckets", None)
    if buckets is not None:
        models["tiny"]["buckets"] = buckets
    (catalog / "models.yaml").write_text(yaml.safe_dump(models))
    phases = yaml.safe_load((catalog / "phases.yaml").read_text())
    phases["demo"]["flip_p"] = flip_p
    (catalog / "phases.yaml").write_text(yaml.safe_dump(phases))
    sources = yaml.safe_load((catalog / "sources.yaml").read_text())
    sources["demo"]["latent_sampling"] = latent_sampling
    (catalog / "sources.yaml").write_text(yaml.safe_dump(sources))
    return catalog


def test_the_catalogs_spec_decides_the_layout_and_a_change_re_encodes(
    prefect_stack, tmp_path, monkeypatch
):
    from prefect.logging.handlers import APILogWorker

    from catalog import load_catalog
    from flows.build_latents import build_latents

    # Both catalogs say their layout outright, whatever the shipped one holds: the legacy one
    # without buckets, flips or latent sampling; the flipped one with buckets and flips only.
    legacy = _catalog(tmp_path / "legacy", buckets=None, flip_p=0.0, latent_sampling=False)
    flipped = _catalog(tmp_path / "flipped", buckets=PLAN, flip_p=0.5, latent_sampling=False)
    root = tmp_path / "data"
    latents = root / "demo" / "latents"

    monkeypatch.setenv("SDPIPE_CATALOG", str(flipped))
    state = build_latents(source="demo", data_root=str(root), workers=2, return_state=True)
    APILogWorker.drain_all()
    assert state.is_completed(), state.message
    spec = encode.spec_for(load_catalog(), "demo")
    assert (spec.views, spec.channels, spec.legacy) == (2, 4, False)
    records = read_stats(root, "demo", "latents")
    assert records and all(r.extra["latent_spec"] == spec.to_dict() for r in records)
    assert not list(latents.glob("[0-9][0-9][0-9][0-9][0-9].npy"))
    for r in records:
        table = latent_keys.read(root, "demo", r.shard)
        assert latent_keys.spec(table) == spec.to_dict()
        assert table.num_rows == r.num_out > 0
        for bucket, n in r.extra["buckets"].items():
            z = np.load(latent_keys.latents_path(root, "demo", r.shard, bucket), mmap_mode="r")
            w, h = (int(v) for v in bucket.split("x"))
            assert z.shape == (n, 2, 4, h // 8, w // 8)

    monkeypatch.setenv("SDPIPE_CATALOG", str(legacy))
    state = build_latents(source="demo", data_root=str(root), workers=2, return_state=True)
    APILogWorker.drain_all()
    assert state.is_completed(), state.message
    records = read_stats(root, "demo", "latents")
    assert all(not r.extra.get("buckets") for r in records)
    assert sorted(p.name for p in latents.glob("*.npy")) == [f"{r.shard}.npy" for r in records]
    for r in records:
        assert latent_keys.read(root, "demo", r.shard).schema.names == ["key", "token_row"]
        assert np.load(latents / f"{r.shard}.npy").shape == (r.num_out, 4, 8, 8)
