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
from tasks.curation import filter, filter_pixels
from tasks.latents import latent_keys, tokenize
from tasks.sources import demo_source, fetch_images, metadata

pytestmark = pytest.mark.slow

# A VAE big enough that one shard takes about a second on CPU, so the kill lands mid-stage.
ENCODE_SCRIPT = """
import sys, dataclasses
from pathlib import Path
from catalog import load_catalog
from tasks.latents.encode import encode_shard
root = Path(sys.argv[1])
tiny = load_catalog().model("tiny")
vae = dict(tiny.vae_config, block_out_channels=[64, 128, 128, 128], layers_per_block=2,
           norm_num_groups=32)
model = dataclasses.replace(tiny, name="kill-test", vae_config=vae)
for tokens in sorted((root / "demo" / "tokens").glob("[0-9]*.parquet")):
    encode_shard(root, "demo", tokens.stem, model, batch_size=4)
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
                root,
                "demo",
                p.stem,
                image_size=src.resolution,
                min_side=profile.min_side,
                allow_private_hosts=src.allow_private_hosts,
            )
    filter_pixels.select_pixels(root, "demo", profile)
    for p in sorted((root / "demo" / "selected").glob("[0-9]*.parquet")):
        tokenize.tokenize_shard(root, "demo", p.stem)
    return root


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
    # No partial file under a final name: every final latent file (one per bucket of a shard,
    # the tiny model's plan: [n, 1 view, 4 channels, h/8, w/8]) loads whole.
    for npy in latents.glob("[0-9]*.npy"):
        w, h = (int(v) for v in npy.name.split(".")[1].split("x"))
        assert np.load(npy).shape[1:] == (1, 4, h // 8, w // 8)
    mtimes = _outputs(latents, done)
    assert len(mtimes) >= 3 * len(done)  # each done shard: its bucket files, keys and record

    assert _encode(killed).wait() == 0
    assert _encode(clean).wait() == 0
    # The rerun skipped the shards already done and finished the rest ...
    assert _outputs(latents, done) == mtimes
    assert len(list(latents.glob("*.stats.json"))) == num_shards
    assert not [p for p in latents.iterdir() if ".tmp-" in p.name]
    # ... and its latents equal those of the uninterrupted run, shard by shard, bucket by bucket.
    clean_latents = clean / "demo" / "latents"
    files = sorted(p.name for p in clean_latents.glob("[0-9]*.npy"))
    assert files and files == sorted(p.name for p in latents.glob("[0-9]*.npy"))
    for name in files:
        np.testing.assert_array_equal(np.load(clean_latents / name), np.load(latents / name))
    for shard in sorted(p.stem for p in (clean / "demo" / "tokens").glob("[0-9]*.parquet")):
        a = latent_keys.read(clean, "demo", shard)
        assert "bucket" in a.schema.names and a.equals(latent_keys.read(killed, "demo", shard))


def _outputs(latents: Path, shards: list[str]) -> dict[str, int]:
    """mtime of every file of `shards` under latents/ (bucket files, keys file, record)."""
    return {
        p.name: p.stat().st_mtime_ns
        for s in shards
        for p in latents.glob(f"{s}.*")
        if ".tmp-" not in p.name
    }
