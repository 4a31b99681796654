"""A 32-row phase set on the tiny model, and two finished runs of it shared by the trainer tests.

The runs are the same training twice: 2 gloo ranks x batch 4 under torchrun (with channels_last
and gradient checkpointing, as on a GPU), and 1 in-process rank x batch 8. Each is 6 optimizer
steps of 2 micro-batches over 28 training rows (4 held out), crossing epoch boundaries.

Beside it, a 40-row bucketed phase set (three buckets, one too small to train on, flips
encoded, some files with the posterior's log-variance) and one in-process run of it with
flips on: the reference of the bucketed resume and DDP tests.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sdtrain import layout
from sdtrain.config import TrainConfig
from sdtrain.models import tokenize
from tests.torch_threads import one_torch_thread

NUM_ROWS_PER_SHARD = 16
SHARDS = ("00000", "00001")
RUN = dict(
    phase="demo", model="tiny", lr=1e-3, warmup_steps=2, epochs=4, max_steps=6, batch_size=8,
    grad_accum=2, cfg_dropout=0.2, min_snr_gamma=5.0, num_val_samples=4, validate_every=3,
    checkpoint_every=2, keep_every=4, log_every=1, sample_every=3, sample_steps=5,
    channels_last=False, gradient_checkpointing=False, deterministic=True,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _every_module_on_one_torch_thread(one_torch_thread_per_module):
    """Every test here runs on one torch thread (tests/torch_threads.py)."""
    yield


def caption(shard: str, i: int) -> str:
    return f"a photo of object {int(shard) * NUM_ROWS_PER_SHARD + i}"


@pytest.fixture(scope="session")
def phase_dir(tmp_path_factory):
    """Two shards of 16 rows, laid out as the mix stage writes them (symlinked files, token ids
    as parquet and .npy, the row index `rows.npy` + `files.json`).

    The token files are stored in reverse order, so token_row != latent_row and the manifest's
    join is what PhaseSet must follow.
    """
    root = tmp_path_factory.mktemp("data")
    phase = root / "phase"
    (phase / "latents").mkdir(parents=True)
    (phase / "tokens").mkdir()
    rng = np.random.default_rng(0)
    manifest = {k: [] for k in ("dataset", "source", "shard", "latent_row", "token_row", "key")}
    for shard in SHARDS:
        latents = (rng.standard_normal((NUM_ROWS_PER_SHARD, 4, 8, 8)) * 0.8).astype(np.float16)
        np.save(root / f"latents-{shard}.npy", latents)
        keys = [f"demo/{shard}/{i:04d}" for i in range(NUM_ROWS_PER_SHARD)]
        ids = tokenize([caption(shard, i) for i in range(NUM_ROWS_PER_SHARD)]).to(torch.int32)
        reverse = list(range(NUM_ROWS_PER_SHARD))[::-1]
        tokens = pa.table(
            {"key": [keys[i] for i in reverse], "input_ids": [ids[i].tolist() for i in reverse]}
        )
        pq.write_table(tokens, root / f"tokens-{shard}.parquet")
        np.save(root / f"tokens-{shard}.npy", ids.numpy()[reverse])
        (phase / "latents" / f"demo-{shard}.npy").symlink_to(root / f"latents-{shard}.npy")
        (phase / "tokens" / f"demo-{shard}.parquet").symlink_to(root / f"tokens-{shard}.parquet")
        (phase / "tokens" / f"demo-{shard}.npy").symlink_to(root / f"tokens-{shard}.npy")
        for i in range(NUM_ROWS_PER_SHARD):
            manifest["dataset"].append("demo")
            manifest["source"].append("demo")
            manifest["shard"].append(shard)
            manifest["latent_row"].append(i)
            manifest["token_row"].append(NUM_ROWS_PER_SHARD - 1 - i)
            manifest["key"].append(keys[i])
    table = pa.table(manifest)
    pq.write_table(table, phase / "manifest.parquet")
    layout.write_index(phase, *layout.index_of(table))
    return phase


def write_phase_set(folder, files: list[dict]):
    """A phase set as mix writes one of buckets (docs/training-data.md "Phase sets"), by hand.

    Each file: `name`, `latents` (array [n, V, C, h, w], or legacy [N, 4, h, w]), optional
    `bucket`, `views`, `channels` for its files.json entry; row i of each file, in file order,
    is a manifest row, token ids of `caption(shard, i)`.
    """
    (folder / "latents").mkdir(parents=True)
    (folder / "tokens").mkdir()
    manifest = {k: [] for k in ("dataset", "source", "shard", "latent_row", "token_row", "key")}
    manifest["bucket"] = []
    rows, entries = [], {}
    for f, spec in enumerate(files):
        name, latents = spec["name"], spec["latents"]
        source, rest = name.split("-", 1)
        shard, _, bucket = rest.partition(".")
        np.save(folder / "latents" / f"{name}.npy", latents)
        ids = tokenize([caption(shard, i) for i in range(len(latents))]).to(torch.int32)
        np.save(folder / "tokens" / f"{name}.npy", ids.numpy())
        for i in range(len(latents)):
            manifest["dataset"].append(source)
            manifest["source"].append(source)
            manifest["shard"].append(shard)
            manifest["latent_row"].append(i)
            manifest["token_row"].append(i)
            manifest["key"].append(f"{source}/{shard}/{bucket}/{i:04d}")
            manifest["bucket"].append(bucket)
            rows.append((f, i, i))
        entries[name] = {k: spec[k] for k in ("bucket", "views", "channels") if k in spec}
    pq.write_table(pa.table(manifest), folder / "manifest.parquet")
    layout.write_index(folder, [f["name"] for f in files], np.array(rows, np.int32))
    meta = json.loads((folder / layout.FILES).read_text())
    for entry in meta["files"]:
        entry.update(entries[entry["name"]])
    (folder / layout.FILES).write_text(json.dumps(meta))
    return folder


def bucket_latents(rng, n: int, h: int, w: int, *, channels: int) -> np.ndarray:
    """fp16 [n, 2, channels, h, w]: view 1 the mirror of view 0 (as the VAE's latents of a
    mirrored image nearly are); channels 4..7 a log-variance around log(0.01)."""
    mean = rng.standard_normal((n, 4, h, w)) * 0.8
    stored = mean if channels == 4 else np.concatenate([mean, rng.normal(-4.6, 0.3, mean.shape)], 1)
    return np.stack([stored, stored[..., ::-1]], axis=1).astype(np.float16)


# The bucketed set: 12 + 10 rows of 64x64 (8 x 8 latents), 15 of 80x48 (6 x 10), 3 of 48x80
# (10 x 6). Seed 0 holds out rows 10, 13, 29, 39: 20, 14 and 2 training rows. At a global batch
# of 8, 64x64 gives 2 full batches and one of 4, 80x48 one full and one of 6, and 48x80 is left
# out (small_bucket): 5 batches an epoch, each split evenly over 1 or 2 ranks.
BUCKETED_FILES = (
    ("demo-00000.64x64", 12, 8, 8, 4),
    ("demo-00001.64x64", 10, 8, 8, 8),
    ("demo-00000.80x48", 15, 6, 10, 8),
    ("demo-00001.48x80", 3, 10, 6, 4),
)


@pytest.fixture(scope="session")
def bucketed_phase_dir(tmp_path_factory):
    rng = np.random.default_rng(1)
    files = [
        {
            "name": name,
            "latents": bucket_latents(rng, n, h, w, channels=channels),
            "bucket": name.split(".")[1],
            "views": 2,
            "channels": channels,
        }
        for name, n, h, w, channels in BUCKETED_FILES
    ]
    return write_phase_set(tmp_path_factory.mktemp("bucketed") / "phase", files)


@pytest.fixture(scope="session")
def make_config(phase_dir):
    def make(run_dir, **overrides) -> TrainConfig:
        return TrainConfig(
            **{"phase_dir": str(phase_dir), "run_dir": str(run_dir), **RUN, **overrides}
        )

    return make


@pytest.fixture(scope="session")
def two_rank_run(make_config, tmp_path_factory):
    """(config, summary, console lines) of the 2-rank torchrun run."""
    from tasks.phases.train import launch_training

    config = make_config(
        tmp_path_factory.mktemp("run-2-ranks"),
        batch_size=4,
        channels_last=True,
        gradient_checkpointing=True,
        deterministic=False,  # compared within a tolerance; saves importing torch._inductor
    )
    lines: list[str] = []
    summary = launch_training(config, nproc=2, on_line=lines.append)
    return config, summary, lines


@pytest.fixture(scope="session")
def make_bucketed_config(make_config, bucketed_phase_dir):
    def make(run_dir, **overrides) -> TrainConfig:
        return make_config(run_dir, phase_dir=str(bucketed_phase_dir), flip_p=0.5, **overrides)

    return make


@pytest.fixture(scope="session")
def bucketed_one_rank_run(make_bucketed_config, tmp_path_factory):
    """(config, summary) of a run on the bucketed set, flips on, in this process."""
    from sdtrain.train import train

    config = make_bucketed_config(tmp_path_factory.mktemp("bucketed-1-rank"), sample_every=0)
    with one_torch_thread():
        return config, train(config)


@pytest.fixture(scope="session")
def one_rank_run(make_config, tmp_path_factory):
    """(config, summary) of the same training in this process, on the full batch."""
    from sdtrain.train import train

    config = make_config(tmp_path_factory.mktemp("run-1-rank"))
    with one_torch_thread():  # session fixtures start before the module-scoped one
        return config, train(config)


def sigterm_at_draw(monkeypatch, call: int):
    """SIGTERM to this process at the `call`-th noise draw of the trainer (the loop's draws,
    the mode's, and validation's): a cancel arriving mid-run, at a chosen point. Returns the
    function that puts the plain draws back (for the rerun)."""
    import os
    import signal

    from sdtrain import modes
    from sdtrain import train as train_module

    calls = []
    draw_noise = train_module.draw_noise

    def signalled_draw_noise(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return draw_noise(*args, **kwargs)

    for module in (train_module, modes):
        monkeypatch.setattr(module, "draw_noise", signalled_draw_noise)

    def restore() -> None:
        for module in (train_module, modes):
            monkeypatch.setattr(module, "draw_noise", draw_noise)

    return restore
