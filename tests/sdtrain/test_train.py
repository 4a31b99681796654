"""The trainer on the tiny model: a 2-rank torchrun run end to end, and its pieces one by one."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from sdtrain.config import TrainConfig
from sdtrain.data import EpochSampler, PhaseSet
from sdtrain.models import tokenize
from sdtrain.sampling import NOISE_SCHEDULE
from sdtrain.train import build_lr_schedule, min_snr_weights, total_optimizer_steps, train
from tasks.shards import TMP_MARK
from tasks.train import TrainingFailed, launch_training

NUM_ROWS_PER_SHARD = 16
SHARDS = ("00000", "00001")


def caption(shard: str, i: int) -> str:
    return f"a photo of object {int(shard) * NUM_ROWS_PER_SHARD + i}"


@pytest.fixture(scope="module")
def phase_dir(tmp_path_factory):
    """Two shards of 16 rows, laid out as the mix stage writes them (symlinked files).

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
        (phase / "latents" / f"demo-{shard}.npy").symlink_to(root / f"latents-{shard}.npy")
        (phase / "tokens" / f"demo-{shard}.parquet").symlink_to(root / f"tokens-{shard}.parquet")
        for i in range(NUM_ROWS_PER_SHARD):
            manifest["dataset"].append("demo")
            manifest["source"].append("demo")
            manifest["shard"].append(shard)
            manifest["latent_row"].append(i)
            manifest["token_row"].append(NUM_ROWS_PER_SHARD - 1 - i)
            manifest["key"].append(keys[i])
    pq.write_table(pa.table(manifest), phase / "manifest.parquet")
    return phase


def tiny_config(phase_dir, run_dir, **overrides) -> TrainConfig:
    fields = dict(
        phase="demo", phase_dir=str(phase_dir), run_dir=str(run_dir), model="tiny", lr=1e-3,
        warmup_steps=2, epochs=4, max_steps=6, batch_size=4, grad_accum=2, cfg_dropout=0.2,
        min_snr_gamma=5.0, log_every=2, sample_every=3, sample_steps=5,
    )  # fmt: skip
    return TrainConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def finished_run(phase_dir, tmp_path_factory):
    config = tiny_config(phase_dir, tmp_path_factory.mktemp("run"))
    lines: list[str] = []
    summary = launch_training(config, nproc=2, on_line=lines.append)
    return config, summary, lines


def test_phase_set_joins_latents_and_tokens_by_manifest(phase_dir):
    dataset = PhaseSet(phase_dir)
    assert len(dataset) == 2 * NUM_ROWS_PER_SHARD
    latent, input_ids = dataset[NUM_ROWS_PER_SHARD + 3]  # shard 00001, row 3
    expected = np.load(phase_dir / "latents" / "demo-00001.npy")[3].astype(np.float32)
    assert latent.dtype == torch.float32 and latent.shape == (4, 8, 8)
    assert torch.equal(latent, torch.from_numpy(expected))
    assert input_ids.dtype == torch.int64
    assert torch.equal(input_ids, tokenize([caption("00001", 3)])[0])


def test_two_rank_run_writes_checkpoint_samples_and_summary(finished_run):
    config, summary, lines = finished_run
    run = Path(config.run_dir)
    assert TrainConfig.from_json(run / "config.json") == config
    assert Path(summary["checkpoint"]) == run / "final"
    assert summary["phase"] == "demo" and summary["steps"] == 6 and summary["world_size"] == 2
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    assert summary["samples_per_s"] > 0

    step_lines = [line for line in lines if line.startswith("step ")]
    assert [int(re.match(r"step (\d+)/6 loss=\d+\.\d{4} lr=\d\.\d\de-\d\d$", line)[1])
            for line in step_lines] == [2, 4, 6]  # fmt: skip
    logged = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [2, 4, 6]
    assert logged[-1]["loss"] == pytest.approx(summary["last_loss"])

    unet, ema = (
        load_file(f"{summary['checkpoint']}/{n}.safetensors") for n in ("unet", "unet_ema")
    )
    assert unet.keys() == ema.keys() and "conv_out.weight" in unet
    assert any(not torch.equal(unet[k], ema[k]) for k in unet)  # EMA lags the live weights
    grid = Image.open(summary["sample_grid"])
    assert Path(summary["sample_grid"]) == run / "samples" / "final.png"
    assert grid.size == (4 * 64, 64)  # the 4 default prompts in one row of 64px images
    assert (run / "samples" / "step-000003.png").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert not [p for p in run.rglob("*") if TMP_MARK in p.name]


def test_init_from_starts_from_previous_final_weights(finished_run, phase_dir, tmp_path):
    # A plain in-process run (no torchrun) with lr 0: the live weights must stay the loaded ones.
    _, first, _ = finished_run
    config = tiny_config(
        phase_dir, tmp_path, init_from=first["checkpoint"], lr=0.0, max_steps=1, grad_accum=1
    )
    summary = train(config)
    assert summary["steps"] == 1 and summary["world_size"] == 1
    before = load_file(f"{first['checkpoint']}/unet.safetensors")
    after = load_file(f"{summary['checkpoint']}/unet.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_failed_rank_raises_with_its_error(tmp_path):
    config = tiny_config(tmp_path / "missing-phase", tmp_path / "run")
    with pytest.raises(TrainingFailed, match="torchrun exited with 1") as failure:
        launch_training(config, nproc=1, on_line=lambda line: None)
    assert "FileNotFoundError" in str(failure.value)  # the rank's own error, not just torchrun's


def test_total_steps_come_from_per_rank_loader_length(phase_dir):
    sampler = EpochSampler(2 * NUM_ROWS_PER_SHARD, seed=0, rank=0, world_size=2)
    loader = DataLoader(PhaseSet(phase_dir), batch_size=4, sampler=sampler, drop_last=True)
    assert len(loader) == 4  # 32 rows / 2 ranks / batch 4, not 32 / 4
    assert total_optimizer_steps(len(loader), epochs=3, grad_accum=2, max_steps=None) == 6
    assert total_optimizer_steps(len(loader), epochs=3, grad_accum=2, max_steps=5) == 5


def test_lr_warms_up_then_cosine_ends_at_one_percent():
    lr, warmup_steps, total_steps = 1e-3, 3, 10
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = build_lr_schedule(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)
    used = []
    for _ in range(total_steps):
        used.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert used[0] == pytest.approx(lr * 1e-2)
    assert used[: warmup_steps + 1] == sorted(used[: warmup_steps + 1])
    assert used[warmup_steps] == pytest.approx(lr)
    assert used[warmup_steps:] == sorted(used[warmup_steps:], reverse=True)
    assert schedule.get_last_lr()[0] == pytest.approx(lr * 1e-2)


def test_min_snr_weights_match_hand_computed_values():
    from diffusers import DDPMScheduler

    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    alpha_bar = np.cumprod(1 - betas)
    timesteps = [0, 100, 400, 999]
    gamma = 5.0
    alphas_cumprod = DDPMScheduler(**NOISE_SCHEDULE).alphas_cumprod
    weights = min_snr_weights(torch.tensor(timesteps), alphas_cumprod, gamma)
    snr = alpha_bar[timesteps] / (1 - alpha_bar[timesteps])
    expected = np.minimum(snr, gamma) / snr
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-4)
    assert expected[0] < 0.01 and expected[-1] == 1.0  # low noise is down-weighted, high is not


def test_epoch_sampler_is_seeded_sharded_and_resumable():
    def order(epoch, rank=0, world_size=1, start=0):
        sampler = EpochSampler(35, seed=7, rank=rank, world_size=world_size)
        sampler.set_epoch(epoch, start=start)
        assert len(sampler) == len(list(sampler))
        return list(sampler)

    assert order(epoch=0) == order(epoch=0)
    assert order(epoch=0) != order(epoch=1)
    shards = [order(epoch=2, rank=r, world_size=3) for r in range(3)]
    assert all(len(s) == 11 for s in shards)  # 35 truncated to 33, 11 per rank
    assert len(set().union(*shards)) == 33
    assert sorted(i for s in shards for i in s) == sorted(order(epoch=2)[:33])
    assert order(epoch=2, rank=1, world_size=3, start=4) == shards[1][4:]
