"""SIGKILL the encode stage mid-run: the rerun finishes the rest and matches a clean run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from catalog import load_catalog
from tasks import demo_source, fetch_images, filter, latent_keys, metadata, tokenize

pytestmark = pytest.mark.slow

# A VAE big enough that one shard takes about a second on CPU, so the kill lands mid-stage.
ENCODE_SCRIPT = """
import sys, dataclasses
from pathlib import Path
from catalog import load_catalog, needs_flips
from tasks.encode import LatentSpec, encode_shard
root = Path(sys.argv[1])
catalog = load_catalog()
tiny = catalog.model("tiny")
vae = dict(tiny.vae_config, block_out_channels=[64, 128, 128, 128], layers_per_block=2,
           norm_num_groups=32)
model = dataclasses.replace(tiny, name="kill-test", vae_config=vae)
# The layout the catalog gives the demo source (encode.spec_for), with this model's VAE.
spec = LatentSpec.of(
    model, flips=needs_flips(catalog, "demo"), sampling=catalog.source("demo").latent_sampling
)
for tokens in sorted((root / "demo" / "tokens").glob("[0-9]*.parquet")):
    encode_shard(root, "demo", tokens.stem, model, batch_size=4, spec=spec)
"""


@pytest.fixture(scope="module")
def tokenized_root(tmp_path_factory, small_catalog) -> Path:
    """A data root with the small demo source fetched and tokenized (inputs of encode)."""
    os.environ["SDPIPE_CATALOG"] = str(small_catalog)
    try:
        catalog = load_catalog()
    finally:
        del os.environ["SDPIPE_CATALOG"]
    root = tmp_path_factory.mktemp("kill")
    src, profile = catalog.source("demo"), catalog.profile("demo")
    for i, f in enumerate(metadata.list_metadata_files(root, src)):
        metadata.fetch_metadata_shard(root, src, i, f)
    filter.filter_metadata(root, "demo", profile, src.samples_per_shard)
    with demo_source.serve_mirror(root / "demo" / "mirror"):
        for p in sorted((root / "demo" / "filtered").glob("[0-9]*.parquet")):
            fetch_images.fetch_images_shard(
                root, "demo", p.stem, image_size=src.resolution, min_side=profile.min_side
            )
    filter.select_pixels(root, "demo", profile)
    for p in sorted((root / "demo" / "selected").glob("[0-9]*.parquet")):
        tokenize.tokenize_shard(root, "demo", p.stem)
    return root


def done_mtimes(latents: Path, shards: list[str]) -> dict[str, int]:
    """The mtimes of the done shards' latents files (one, or one per bucket)."""
    return {
        p.name: p.stat().st_mtime_ns
        for p in latents.glob("[0-9]*.npy")
        if p.name.split(".")[0] in shards
    }


def _encode(root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", ENCODE_SCRIPT, str(root)], env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def test_sigkill_mid_encode_then_rerun(tokenized_root, tmp_path):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    for dest in (clean, killed):
        shutil.copytree(tokenized_root, dest, symlinks=True)
    num_shards = len(list((killed / "demo" / "tokens").glob("[0-9]*.parquet")))
    assert num_shards >= 3

    proc = _encode(killed)
    latents = killed / "demo" / "latents"
    deadline = time.monotonic() + 120
    while not list(latents.glob("*.stats.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # into the next shard's work
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    done = sorted(p.name.split(".")[0] for p in latents.glob("*.stats.json"))
    assert 1 <= len(done) < num_shards, "the kill must land mid-stage"
    # No partial file under a final name: every final latents file (the legacy `NNNNN.npy` or a
    # bucket's `NNNNN.WxH.npy`) loads whole, latents of its bucket's size.
    for npy in latents.glob("[0-9]*.npy"):
        name = npy.name.split(".")
        w, h = (int(v) for v in name[1].split("x")) if len(name) == 3 else (64, 64)
        z = np.load(npy)
        assert z.dtype == np.float16 and z.shape[-3:] in ((4, h // 8, w // 8), (8, h // 8, w // 8))
    mtimes = done_mtimes(latents, done)
    assert mtimes

    assert _encode(killed).wait() == 0
    assert _encode(clean).wait() == 0
    # The rerun skipped the shards already done and finished the rest ...
    assert done_mtimes(latents, done) == mtimes
    assert len(list(latents.glob("*.stats.json"))) == num_shards
    assert not [p for p in latents.iterdir() if ".tmp-" in p.name]
    # ... and its latents equal those of the uninterrupted run, shard by shard.
    clean_files = sorted((clean / "demo" / "latents").glob("[0-9]*.npy"))
    assert [p.name for p in clean_files] == sorted(p.name for p in latents.glob("[0-9]*.npy"))
    for npy in clean_files:
        np.testing.assert_array_equal(np.load(npy), np.load(latents / npy.name))
    for shard in sorted({p.name.split(".")[0] for p in clean_files}):
        a = latent_keys.read(clean, "demo", shard)
        b = latent_keys.read(killed, "demo", shard)
        assert a.equals(b)  # keys, token rows and (bucketed) each key's bucket and row
