"""The trainer end to end on the tiny model: a 2-rank torchrun run, DDP equivalence, chaining."""

from __future__ import annotations

import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from flows import train_pictures
from flows.curriculum import parse_step_line
from sdtrain import layout
from sdtrain.atomic import TMP_MARK
from sdtrain.checkpoint import read_ema_step
from sdtrain.config import TrainConfig
from sdtrain.data import PhaseSet
from sdtrain.ema import EMA
from sdtrain.models import tokenize
from sdtrain.monitor import read_log
from sdtrain.schedules import ema_decay
from sdtrain.train import train
from tasks.phases.train import TrainingFailed, launch_training
from tasks.runtime.net import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]
NUM_ROWS_PER_SHARD = 16
STEP_LINE = re.compile(
    r"step (\d+)/6 loss=\d+\.\d{4} lr=\d\.\d\de-\d\d grad_norm=\d+\.\d{3} "
    r"samples/s=\d+\.\d data_wait=\d\.\d{3}$"
)


def losses(run_dir) -> list[dict]:
    return [r for r in read_log(Path(run_dir) / "log.jsonl") if "loss" in r]


def test_phase_set_joins_latents_and_tokens_by_manifest(phase_dir):
    dataset = PhaseSet(phase_dir)
    assert len(dataset) == 2 * NUM_ROWS_PER_SHARD
    latent, input_ids, row = dataset[NUM_ROWS_PER_SHARD + 3]  # shard 00001, row 3
    expected = np.load(phase_dir / "latents" / "demo-00001.npy")[3].astype(np.float32)
    assert latent.dtype == torch.float32 and latent.shape == (4, 8, 8)
    assert torch.equal(latent, torch.from_numpy(expected))
    assert input_ids.dtype == torch.int64
    assert torch.equal(input_ids, tokenize(["a photo of object 19"])[0])
    assert row == NUM_ROWS_PER_SHARD + 3


def test_latents_loaded_into_ram_are_the_memory_mapped_ones(phase_dir):
    mapped, in_ram = PhaseSet(phase_dir), PhaseSet(phase_dir, in_ram=True, num_threads=2)
    assert len(in_ram.latents) == 1 and layout.mapped_file(in_ram.latents[0]) is None
    for i in range(len(mapped)):
        assert all(torch.equal(a, b) for a, b in zip(mapped[i][:2], in_ram[i][:2], strict=True))


def test_two_rank_run_writes_checkpoints_samples_and_summary(two_rank_run):
    config, summary, lines = two_rank_run
    run = Path(config.run_dir)
    assert TrainConfig.from_json(run / "config.json") == config
    assert summary["phase"] == "demo" and summary["world_size"] == 2
    assert summary["steps"] == summary["total_steps"] == 6 and summary["resumed_from_step"] == 0
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    assert summary["samples_per_s"] > 0 and 0 <= summary["data_wait_fraction"] < 1

    # A console line per step, as the curriculum flow parses them.
    step_lines = [line for line in lines if line.startswith("step ") and " loss=" in line]
    assert [int(STEP_LINE.match(line)[1]) for line in step_lines] == [1, 2, 3, 4, 5, 6]
    logged = losses(run)
    progress = [parse_step_line(line) for line in step_lines]  # the flow's progress artifact
    assert [(p["step"], p["total_steps"]) for p in progress] == [(s, 6) for s in range(1, 7)]
    assert progress[-1]["loss"] == pytest.approx(logged[-1]["loss"], abs=1e-4)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert logged[-1]["loss"] == pytest.approx(summary["last_loss"])
    val = [r for r in read_log(run / "log.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [3, 6]  # validate_every=3 and at the end
    assert summary["best_val_loss"] == min(r["val_loss"] for r in val)

    # Final weights: live and EMA, same names; the EMA lags the live weights.
    assert Path(summary["checkpoint"]) == run / "final"
    unet, ema = (load_file(run / "final" / f"{n}.safetensors") for n in ("unet", "unet_ema"))
    assert unet.keys() == ema.keys() and "conv_out.weight" in unet
    assert any(not torch.equal(unet[k], ema[k]) for k in unet)

    # Keep policy: rolling `latest` (every 2), step 4 kept (keep_every=4), `best` by val loss.
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000004", "step-000006"]
    assert os.readlink(checkpoints / "latest") == "step-000006"
    best_step = min(val, key=lambda r: r["val_loss"])["step"]
    assert Path(summary["best_checkpoint"]).name == f"step-{best_step:06d}"
    assert os.readlink(checkpoints / "best") == f"step-{best_step:06d}"

    grid = Image.open(summary["sample_grid"])
    assert grid.size == (4 * 64, 64)  # the 4 default prompts in one row of 64px images
    assert (run / "samples" / "step-000003.png").exists()
    # Each grid is announced, so the curriculum flow redraws the dashboard's pictures then.
    grid_lines = [line for line in lines if train_pictures.GRID_LINE.match(line)]
    assert grid_lines == [
        f"sample grid step 3: {run / 'samples' / 'step-000003.png'}",
        f"sample grid step 6: {run / 'samples' / 'final.png'}",
    ]
    assert {r["total_steps"] for r in logged} == {6}  # a watcher's ETA
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert not [p for p in run.rglob("*") if TMP_MARK in p.name]


def test_two_gloo_ranks_average_to_the_full_batch_gradient(phase_dir, tmp_path):
    script = Path(__file__).with_name("ddp_gradients.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(script), str(phase_dir), str(tmp_path / "g.pt")],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    averaged = torch.load(tmp_path / "g.pt")
    helpers = runpy.run_path(str(script))  # the same loss, all 8 rows in one process
    unet = helpers["unet_with_random_weights"]()
    helpers["loss_of"](unet, str(phase_dir), helpers["ROWS"]).backward()
    assert all(torch.count_nonzero(p.grad) for p in unet.parameters())
    for name, p in unet.named_parameters():
        torch.testing.assert_close(averaged[name], p.grad, rtol=1e-4, atol=1e-7)


def test_two_ranks_match_one_process_on_the_full_batch(two_rank_run, one_rank_run):
    """2 ranks x batch 4 (all-reduced gradients) take the steps 1 process x batch 8 takes."""
    (two, two_summary, _), (one, one_summary) = two_rank_run, one_rank_run
    for a, b in zip(losses(two.run_dir), losses(one.run_dir), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        # The norm of the averaged gradient, before clipping: the same gradients.
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for name in ("unet", "unet_ema"):
        w2, w1 = (load_file(Path(r.run_dir) / "final" / f"{name}.safetensors") for r in (two, one))
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-5)
    assert two_summary["best_val_loss"] == pytest.approx(one_summary["best_val_loss"], rel=1e-5)


class _Stop(Exception):
    """The caller's cancel: launch_training passes a SIGTERM to torchrun's ranks."""


def test_a_bucketed_flipped_run_on_two_ranks_resumes_and_takes_the_one_process_steps(
    bucketed_one_rank_run, make_bucketed_config, tmp_path
):
    """Buckets, flips and latent draws on 2 gloo ranks x batch 4, cancelled mid-epoch and
    resumed: every step as 1 process x batch 8 takes it uninterrupted (each global batch is
    split evenly, so the averaged gradients are the full batch's)."""
    reference, reference_summary = bucketed_one_rank_run
    config = make_bucketed_config(
        tmp_path,
        batch_size=4,
        sample_every=0,
        channels_last=True,
        gradient_checkpointing=True,
        deterministic=False,
    )
    lines: list[str] = []

    def stop_at_step_3(line: str) -> None:
        lines.append(line)
        if line.startswith("step 3/6"):
            raise _Stop

    with pytest.raises(_Stop):
        launch_training(config, nproc=2, on_line=stop_at_step_3)
    stopped = int(os.readlink(tmp_path / "checkpoints" / "latest")[5:])
    assert 3 <= stopped < 6
    summary = launch_training(config, nproc=2, on_line=lines.append)
    assert summary["resumed_from_step"] == stopped and summary["steps"] == 6
    assert summary["left_out"] == {"small_bucket": 2}
    assert summary["small_buckets"] == {"48x80": 2}
    assert summary["buckets"] == {"64x64": 20, "80x48": 14}
    assert any(
        "left out 2 training rows under small_bucket" in line and "48x80 (2)" in line
        for line in lines
    )
    logged, expected = losses(tmp_path), losses(reference.run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(logged, expected, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert summary["best_val_loss"] == pytest.approx(reference_summary["best_val_loss"], rel=1e-5)
    for name in ("unet", "unet_ema"):
        w2, w1 = (
            load_file(Path(r) / "final" / f"{name}.safetensors")
            for r in (tmp_path, reference.run_dir)
        )
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("carry", [True, False])
def test_next_phase_starts_from_live_and_ema_weights(one_rank_run, make_config, tmp_path, carry):
    """Phase chaining: live and EMA weights carry over, and the EMA's age unless the phase says
    otherwise; optimizer and schedule start afresh."""
    _, first = one_rank_run
    config = make_config(
        tmp_path,
        init_from=first["checkpoint"],
        lr=0.0,
        max_steps=1,
        grad_accum=1,
        log_every=1,
        ema_carry=carry,
    )
    summary = train(config)
    assert summary["steps"] == 1 and summary["resumed_from_step"] == 0
    before = {n: load_file(f"{first['checkpoint']}/{n}.safetensors") for n in ("unet", "unet_ema")}
    after = {n: load_file(f"{summary['checkpoint']}/{n}.safetensors") for n in ("unet", "unet_ema")}
    age = read_ema_step(Path(first["checkpoint"]))
    assert age == first["steps"] == 6
    # Carried: the EMA's 7th update (decay (1 + 6) / (10 + 6)); not: a fresh warmup's first,
    # which moves 90% of the way to the live weights.
    decay = ema_decay(age + 1 if carry else 1)
    for k in before["unet"]:
        assert torch.equal(before["unet"][k], after["unet"][k])  # lr 0: live weights unchanged
        expected = decay * before["unet_ema"][k] + (1 - decay) * before["unet"][k]
        torch.testing.assert_close(after["unet_ema"][k], expected)
    assert read_ema_step(Path(summary["checkpoint"])) == (age + 1 if carry else 1)
    assert [r["step"] for r in losses(tmp_path)] == [1]  # the step count starts afresh too


@pytest.mark.parametrize(
    ("age", "steps", "carried_share"),
    [
        (137_000, 1_000, 0.9999**1_000),  # after phase 1 of the recipe: decay at its cap
        (1_000, 100, math.prod((1 + s) / (10 + s) for s in range(1_000, 1_100))),
        (0, 100, math.prod((1 + s) / (10 + s) for s in range(100))),  # a restarted warmup
    ],
)
def test_the_share_of_the_previous_phase_in_a_carried_ema(age, steps, carried_share):
    # The previous phase's EMA is 1, the new phase's live weights 0: what remains of the old
    # EMA after `steps` updates is the product of the decays at the EMA's age, not the run's.
    module = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(module.weight)
    ema = EMA(module, decay=0.9999, every=1, device=torch.device("cpu"), age=age)
    torch.nn.init.zeros_(module.weight)
    for step in range(1, steps + 1):
        ema.update(module, step)
    assert ema.shadow[0].item() == pytest.approx(carried_share, rel=1e-4)
    if age == 137_000:
        assert ema.shadow[0].item() > 0.9  # phase 2 keeps what phase 1 averaged
    if age == 0:
        assert ema.shadow[0].item() < 1e-9  # ... where a restart erased it


def test_failed_rank_raises_with_its_error(make_config, tmp_path):
    config = make_config(tmp_path / "run", phase_dir=str(tmp_path / "missing-phase"))
    with pytest.raises(TrainingFailed, match="torchrun exited with 1") as failure:
        launch_training(config, nproc=1, on_line=lambda line: None)
    assert "FileNotFoundError" in str(failure.value)  # the rank's own error, not just torchrun's
