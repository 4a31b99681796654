"""Interrupted runs resume where they stopped: same losses (bitwise on CPU), same data order."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from sdtrain import modes
from sdtrain import train as train_module
from sdtrain.checkpoint import (
    CheckpointDir,
    CheckpointError,
    KeepPolicy,
    load_weights,
    read_trainer_state,
    strip_prefixes,
    verify_checkpoint,
)
from sdtrain.data import BucketBatchSampler, EpochSampler
from sdtrain.monitor import read_log
from sdtrain.run_data import epoch_batches
from sdtrain.runtime import build_optimizer, load_optimizer_state
from sdtrain.train import TrainingInterrupted, train

from .conftest import bucket_latents, sigterm_at_draw, write_phase_set

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def per_step(run_dir) -> list[tuple]:
    records = [r for r in read_log(Path(run_dir) / "log.jsonl") if "loss" in r]
    return [(r["step"], r["loss"], r["grad_norm"], r["rows_crc"]) for r in records]


def assert_same_weights(run_a, run_b) -> None:
    for name in ("unet", "unet_ema"):
        a, b = (load_file(Path(r) / "final" / f"{name}.safetensors") for r in (run_a, run_b))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_and_the_rerun_resumes_bitwise(one_rank_run, make_config, tmp_path):
    reference, _ = one_rank_run
    config = make_config(tmp_path / "run", sample_every=0)  # grids do not change the training
    config.to_json(tmp_path / "config.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the reference run (conftest)
    with subprocess.Popen(
        [sys.executable, "-m", "sdtrain.train", "--config", str(tmp_path / "config.json")],
        cwd=PROJECT_ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    ) as proc:  # fmt: skip
        output = []
        for line in proc.stdout:
            output.append(line)
            if line.startswith("step 3/6"):
                proc.send_signal(signal.SIGTERM)
    assert proc.returncode == 143, "".join(output)
    stopped_at = int(os.readlink(tmp_path / "run" / "checkpoints" / "latest")[5:])
    assert 3 <= stopped_at < 6
    assert not (tmp_path / "run" / "final").exists()

    summary = train(config)  # the rerun, in this process
    assert summary["resumed_from_step"] == stopped_at and summary["steps"] == 6
    # Every step's loss and gradient norm bitwise, and the rows each step trained on.
    assert per_step(config.run_dir) == per_step(reference.run_dir)
    assert_same_weights(config.run_dir, reference.run_dir)

    changed = dataclasses.replace(config, grad_accum=1)  # another effective batch
    with pytest.raises(
        CheckpointError, match="written by a run with global_batch=16, this run has 8"
    ):
        train(changed)


def test_a_crash_saves_the_last_finished_step(one_rank_run, make_config, tmp_path, monkeypatch):
    reference, _ = one_rank_run
    config = make_config(tmp_path, checkpoint_every=0, keep_every=0, validate_every=0)
    calls = []

    def failing_draw_noise(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:  # the 2nd micro-batch of step 3
            raise RuntimeError("disk error")
        return draw_noise(*args, **kwargs)

    draw_noise = train_module.draw_noise
    for module in (train_module, modes):  # the loop's draws (the mode's) and validation's
        monkeypatch.setattr(module, "draw_noise", failing_draw_noise)
    with pytest.raises(RuntimeError, match="disk error"):
        train(config)
    assert os.readlink(tmp_path / "checkpoints" / "latest") == "step-000002"

    for module in (train_module, modes):
        monkeypatch.setattr(module, "draw_noise", draw_noise)
    assert train(config)["resumed_from_step"] == 2
    assert per_step(tmp_path) == per_step(reference.run_dir)
    assert_same_weights(tmp_path, reference.run_dir)


def assert_resumes_at_every_batch(make, *, done_per_batch: int, batches_per_rank: int) -> None:
    """Stopping after any batch and resuming at its (epoch, done) gives the uninterrupted order:
    none replayed, none skipped, across epoch boundaries and on both ranks. `make(rank)` gives a
    rank's (loader, sampler)."""

    def run(rank, *, start_epoch=0, start_done=0, stop_after=None):
        loader, sampler = make(rank)
        seen = []
        batches = epoch_batches(
            loader,
            sampler,
            start_epoch=start_epoch,
            start_done=start_done,
            num_epochs=3,
            done_per_batch=done_per_batch,
        )
        for epoch, done, batch, _ in batches:
            seen.append(batch.tolist())
            if len(seen) == stop_after:
                return seen, (epoch, done)
        return seen, None

    for rank in (0, 1):
        full, _ = run(rank)
        assert len(full) == batches_per_rank
        for k in range(1, len(full)):
            head, (epoch, done) = run(rank, stop_after=k)
            tail, _ = run(rank, start_epoch=epoch, start_done=done)
            assert head + tail == full


def test_resumed_epochs_continue_at_the_exact_next_sample(phase_dir):
    """The plain order, resumed at a count of samples."""
    rows = list(range(30))

    def make(rank):
        sampler = EpochSampler(len(rows), seed=3, rank=rank, world_size=2)
        return DataLoader(rows, batch_size=4, sampler=sampler, drop_last=True), sampler

    # 30 rows -> 15 per rank -> 3 batches of 4 per epoch
    assert_resumes_at_every_batch(make, done_per_batch=8, batches_per_rank=3 * 3)


class _Rows(Dataset):
    """The row of a (row, epoch) item: what the bucketed sampler hands a phase set."""

    def __getitem__(self, key):
        return key[0]


def test_resumed_bucketed_epochs_continue_at_the_exact_next_batch():
    """The same with batches of one bucket, resumed at a count of global batches."""
    buckets = np.repeat(np.arange(3, dtype=np.int32), [20, 13, 9])
    rows = np.arange(len(buckets), dtype=np.int32) * 3

    def make(rank):
        sampler = BucketBatchSampler(
            rows, buckets, ["512x512", "576x448", "448x576"], batch_size=4, seed=3, rank=rank,
            world_size=2,
        )  # fmt: skip
        return DataLoader(_Rows(), batch_sampler=sampler), sampler

    # 20 rows: 2 batches + a short one; 13: 1 + a short one; 9: 1
    assert_resumes_at_every_batch(make, done_per_batch=1, batches_per_rank=3 * (3 + 2 + 1))


def test_a_bucketed_flipped_run_resumes_mid_epoch_bitwise(
    bucketed_one_rank_run, make_bucketed_config, tmp_path, monkeypatch
):
    """Buckets, flips and latent draws on: a run stopped in its second epoch resumes at the next
    global batch, with every step's loss, gradient norm and rows as the uninterrupted run's."""
    reference, reference_summary = bucketed_one_rank_run
    assert reference_summary["left_out"] == {"small_bucket": 2}
    assert reference_summary["small_buckets"] == {"48x80": 2}
    assert reference_summary["buckets"] == {"64x64": 20, "80x48": 14}
    config = make_bucketed_config(tmp_path, sample_every=0)
    plain_draws = sigterm_at_draw(monkeypatch, 5)  # step 3's first micro-batch: a cancel
    with pytest.raises(TrainingInterrupted, match="at step 3/6"):
        train(config)
    state = read_trainer_state(tmp_path / "checkpoints" / "latest", torch.device("cpu"))
    # 5 batches an epoch: step 3's second micro-batch is the epoch's second batch.
    assert (state["epoch"], state["batches_done"], state["samples_done"]) == (1, 1, None)
    assert state["run_shape"]["batches_per_epoch"] == 5
    plain_draws()

    summary = train(config)
    assert summary["resumed_from_step"] == 3 and summary["steps"] == 6
    assert per_step(config.run_dir) == per_step(reference.run_dir)
    assert_same_weights(config.run_dir, reference.run_dir)
    assert summary["best_val_loss"] == reference_summary["best_val_loss"]


def test_keep_policy_rolls_latest_keeps_periodic_and_best(make_config, tmp_path):
    checkpoints = CheckpointDir(tmp_path, KeepPolicy(checkpoint_every=2, keep_every=4))
    weights = {"w": torch.zeros(2)}
    config = make_config(tmp_path)
    assert [s for s in range(1, 11) if checkpoints.policy.due(s, total_steps=9)] == [
        2,
        4,
        6,
        8,
        9,
        10,
    ]
    for step in (2, 4, 6, 8, 10):
        checkpoints.save(step, is_best=step == 6, unet=weights, unet_ema=weights, config=config)
    assert checkpoints.steps() == [4, 6, 8, 10]  # 4, 8: periodic; 6: best; 10: latest
    assert checkpoints.latest().name == "step-000010"
    assert checkpoints.best().name == "step-000006"
    checkpoints.save(12, unet=weights, unet_ema=weights, config=config)
    assert checkpoints.steps() == [4, 6, 8, 12]


def test_a_corrupt_checkpoint_is_refused(make_config, tmp_path):
    checkpoints = CheckpointDir(tmp_path, KeepPolicy(checkpoint_every=1, keep_every=0))
    weights = {"w": torch.arange(4.0)}
    directory = checkpoints.save(1, unet=weights, unet_ema=weights, config=make_config(tmp_path))
    verify_checkpoint(directory)
    data = bytearray((directory / "unet_ema.safetensors").read_bytes())
    data[-1] ^= 1
    (directory / "unet_ema.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unet_ema.safetensors: missing or corrupt"):
        verify_checkpoint(directory)
    (directory / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(directory)


def test_weights_load_whatever_wrapper_saved_them(tmp_path):
    from safetensors.torch import save_file

    names = [
        "module.conv_in.weight",
        "_orig_mod.conv_in.bias",
        "unet.time_embedding.linear_1.weight",
        "module._orig_mod.conv_out.weight",
        "_fsdp_wrapped_module.down_blocks.0._fsdp_wrapped_module.resnets.0.conv1.weight",
        "mid_block.resnets.0.norm1.weight",
    ]
    wrapped = {name: torch.ones(1) for name in names}
    assert sorted(strip_prefixes(wrapped)) == [
        "conv_in.bias",
        "conv_in.weight",
        "conv_out.weight",
        "down_blocks.0.resnets.0.conv1.weight",
        "mid_block.resnets.0.norm1.weight",
        "time_embedding.linear_1.weight",
    ]
    save_file(wrapped, str(tmp_path / "w.safetensors"))
    torch.save(wrapped, tmp_path / "w.pt")
    assert load_weights(tmp_path / "w.safetensors").keys() == strip_prefixes(wrapped).keys()
    assert load_weights(tmp_path / "w.pt").keys() == strip_prefixes(wrapped).keys()


def test_a_resumed_optimizer_updates_channels_last_weights_as_the_uninterrupted_one(
    make_config, tmp_path
):
    """A checkpoint stores the moments contiguous; the fused AdamW kernel reads them as flat
    memory beside a channels_last weight: restored as stored, they pair with other elements."""
    weight = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(0))
    grads = [torch.randn(weight.shape, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def param_and_optimizer():
        param = torch.nn.Parameter(weight.clone().to(memory_format=torch.channels_last))
        return param, build_optimizer([param], lr=0.1, betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=0.01)  # fmt: skip

    def step(param, optimizer, grad):
        param.grad = grad.to(memory_format=torch.channels_last)
        optimizer.step()

    param, optimizer = param_and_optimizer()
    for grad in grads:
        step(param, optimizer, grad)
    uninterrupted = param.detach().clone()

    param, optimizer = param_and_optimizer()
    step(param, optimizer, grads[0])
    checkpoints = CheckpointDir(tmp_path, KeepPolicy(checkpoint_every=1, keep_every=0))
    saved = checkpoints.save(
        1, unet={"w": param.detach()}, unet_ema={"w": param.detach()},
        config=make_config(tmp_path), trainer={"optimizer": optimizer.state_dict()},
    )  # fmt: skip
    for restore in (lambda o, s: o.load_state_dict(s), load_optimizer_state):
        resumed, optimizer = param_and_optimizer()
        with torch.no_grad():
            resumed.copy_(param)
        restore(optimizer, read_trainer_state(saved, torch.device("cpu"))["optimizer"])
        step(resumed, optimizer, grads[1])
        same = torch.equal(resumed.detach(), uninterrupted)
        assert same == (restore is load_optimizer_state)  # as stored: another update


def test_a_run_resumes_only_in_the_order_it_started_in(make_config, tmp_path):
    """Turning flips on over a checkpoint of the epoch sampler's order is refused: its progress
    counts samples, the bucketed sampler's counts batches of another order."""
    rng = np.random.default_rng(3)
    phase = write_phase_set(
        tmp_path / "phase",
        [{"name": "demo-00000.64x64", "latents": bucket_latents(rng, 16, 8, 8, channels=4),
          "bucket": "64x64", "views": 2, "channels": 4}],
    )  # fmt: skip
    config = make_config(
        tmp_path / "run", phase_dir=str(phase), max_steps=1, grad_accum=1, sample_every=0
    )
    assert train(config)["steps"] == 1  # one bucket, no flips: the epoch sampler
    state = read_trainer_state(tmp_path / "run" / "checkpoints" / "latest", torch.device("cpu"))
    assert state["samples_done"] == 8 and state["batches_done"] is None
    with pytest.raises(
        CheckpointError,
        match="read its phase set in the epoch sampler's order, this run reads it in batches of "
        "one bucket",
    ):
        train(dataclasses.replace(config, flip_p=0.5))
