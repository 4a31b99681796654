"""build-latents encodes the layout the catalog asks for (docs/training-data.md, "Latents on
disk"): a model's bucket plan and a phase's flips give per-bucket files of two views; going back
to the legacy catalog re-encodes every shard, though the earlier run's tasks are cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from tasks import encode, latent_keys
from tasks.shards import read_stats
from tests.conftest import write_small_catalog

pytestmark = pytest.mark.slow

PLAN = {"area": 64 * 64, "step": 16, "min_side": 32, "max_side": 128, "max_aspect": 2}


def edit_catalog(folder: Path, *, buckets: dict | None, flip_p: float | None, sampling: bool):
    """The tiny model's bucket plan, the demo phase's flip_p and the demo source's
    latent_sampling set (None: the field removed)."""
    for file, entry, field, value in (
        ("models.yaml", "tiny", "buckets", buckets),
        ("phases.yaml", "demo", "flip_p", flip_p),
        ("sources.yaml", "demo", "latent_sampling", sampling),
    ):
        data = yaml.safe_load((folder / file).read_text())
        data[entry].pop(field, None)
        if value is not None:
            data[entry][field] = value
        (folder / file).write_text(yaml.safe_dump(data))
    return folder


def test_the_catalogs_spec_decides_the_layout_and_a_change_re_encodes(
    prefect_stack, tmp_path, monkeypatch
):
    from prefect.logging.handlers import APILogWorker

    from catalog import load_catalog
    from flows.build_latents import build_latents

    # The shipped demo trains on buckets with flips and latent sampling: both catalogs say
    # theirs. legacy: no plan, no flips, no log-variance; flipped: PLAN and flips, no
    # log-variance (4 channels).
    legacy = edit_catalog(
        write_small_catalog(tmp_path / "legacy"), buckets=None, flip_p=None, sampling=False
    )
    flipped = edit_catalog(
        write_small_catalog(tmp_path / "flipped"), buckets=PLAN, flip_p=0.5, sampling=False
    )
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
