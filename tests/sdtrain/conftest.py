"""A 32-row phase set on the tiny model, and two finished runs of it shared by the trainer tests.

The runs are the same training twice: 2 gloo ranks x batch 4 under torchrun (with channels_last
and gradient checkpointing, as on a GPU), and 1 in-process rank x batch 8. Each is 6 optimizer
steps of 2 micro-batches over 28 training rows (4 held out), crossing epoch boundaries.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sdtrain import layout
from sdtrain.config import TrainConfig
from sdtrain.models import tokenize

NUM_ROWS_PER_SHARD = 16
SHARDS = ("00000", "00001")
RUN = dict(
    phase="demo", model="tiny", lr=1e-3, warmup_steps=2, epochs=4, max_steps=6, batch_size=8,
    grad_accum=2, cfg_dropout=0.2, min_snr_gamma=5.0, num_val_samples=4, validate_every=3,
    checkpoint_every=2, keep_every=4, log_every=1, sample_every=3, sample_steps=5,
    channels_last=False, gradient_checkpointing=False, deterministic=True,
)  # fmt: skip


@contextlib.contextmanager
def one_torch_thread():
    """The tiny model gains nothing from intra-op threads, and on a loaded 2-core machine their
    barriers stall a step 4-8x. Every run here uses one (ranks and subprocesses too): CPU
    kernels split their sums by thread, so bitwise comparisons need the same count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
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
    from tasks.train import launch_training

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
def one_rank_run(make_config, tmp_path_factory):
    """(config, summary) of the same training in this process, on the full batch."""
    from sdtrain.train import train

    config = make_config(tmp_path_factory.mktemp("run-1-rank"))
    with one_torch_thread():  # session fixtures start before the module-scoped one
        return config, train(config)
