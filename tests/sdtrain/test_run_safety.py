"""What a week-long run relies on: a cancel checkpoints at the next step, a NaN never reaches the
weights or a checkpoint, checkpoints are swapped in whole and read without pickle, a corrupt
`latest` falls back to the newest good one, and a resume refuses another phase set."""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from sdtrain import modes
from sdtrain import train as train_module
from sdtrain.atomic import replace_dir
from sdtrain.checkpoint import (
    CHECKSUMS,
    CheckpointDir,
    CheckpointError,
    KeepPolicy,
    read_trainer_state,
    write_checkpoint,
)
from sdtrain.monitor import read_log
from sdtrain.train import TrainingDiverged, TrainingInterrupted, train

from .conftest import sigterm_at_draw


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "unet.safetensors"))


def test_a_signal_between_log_steps_checkpoints_at_the_next_step(
    one_rank_run, make_config, tmp_path, monkeypatch
):
    reference, _ = one_rank_run
    # Logs every 4 steps, no periodic checkpoint: the stop is seen at the next step anyway.
    config = make_config(tmp_path, log_every=4, checkpoint_every=0, keep_every=0, sample_every=0)
    plain_draws = sigterm_at_draw(monkeypatch, 5)  # step 3's first micro-batch: a cancel
    with pytest.raises(TrainingInterrupted, match="at step 3/6"):
        train(config)
    assert os.readlink(tmp_path / "checkpoints" / "latest") == "step-000003"
    plain_draws()
    assert train(config)["resumed_from_step"] == 3
    reference_weights = final_weights(reference.run_dir)
    resumed = final_weights(tmp_path)
    assert all(torch.equal(resumed[k], reference_weights[k]) for k in reference_weights)


def _nan_on(steps: set[int], monkeypatch) -> None:
    """The loss of every micro-batch of these optimizer steps (2 micro-batches each) is NaN."""
    loss_fn, calls = train_module.diffusion_loss, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = loss_fn(*args, **kwargs)
        return loss * float("nan") if (len(calls) + 1) // 2 in steps else loss

    for module in (train_module, modes):  # the loop's loss (the mode's) and validation's
        monkeypatch.setattr(module, "diffusion_loss", poisoned)


def test_a_nan_step_is_skipped_and_counted(make_config, tmp_path, monkeypatch):
    # Steps 1-2 are the warmup (the same lr whatever the run's length): a run whose step 3 is
    # NaN ends with the weights and EMA of a clean 2-step run, bit for bit.
    config = make_config(tmp_path / "run", max_steps=3, validate_every=0, sample_every=0)
    clean = make_config(tmp_path / "clean", max_steps=2, validate_every=0, sample_every=0)
    _nan_on({3}, monkeypatch)
    summary = train(config)
    assert summary["nonfinite_steps"] == 1 and summary["steps"] == 3
    records = {r["step"]: r for r in read_log(tmp_path / "run" / "log.jsonl") if "loss" in r}
    assert [records[s]["nonfinite_steps"] for s in (1, 2, 3)] == [0, 0, 1]
    monkeypatch.undo()
    train(clean)
    for name in ("unet", "unet_ema"):
        skipped = load_file(str(tmp_path / "run" / "final" / f"{name}.safetensors"))
        two_steps = load_file(str(tmp_path / "clean" / "final" / f"{name}.safetensors"))
        assert all(torch.equal(skipped[k], two_steps[k]) for k in two_steps), name
    state = read_trainer_state(tmp_path / "run" / "checkpoints" / "latest", torch.device("cpu"))
    assert state["num_nonfinite"] == 1


def test_nan_steps_in_a_row_stop_the_run_naming_the_step(make_config, tmp_path, monkeypatch):
    config = make_config(tmp_path, max_nonfinite_steps=3, validate_every=0, sample_every=0)
    _nan_on({3, 4, 5, 6}, monkeypatch)
    with pytest.raises(TrainingDiverged, match=r"3 optimizer steps in a row .* step 5/6"):
        train(config)
    # The last checkpoint is the one written before (step 4: its weights are step 2's).
    latest = CheckpointDir(tmp_path / "checkpoints", KeepPolicy(checkpoint_every=2, keep_every=4))
    assert latest.latest().name == "step-000004"
    assert not (tmp_path / "final").exists()


def test_no_checkpoint_from_non_finite_weights(make_config, tmp_path):
    weights = {"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")])}
    with pytest.raises(CheckpointError, match="non-finite live weights .* e.g. b"):
        write_checkpoint(
            tmp_path / "step", unet=weights, unet_ema=weights, config=make_config(tmp_path)
        )
    assert not (tmp_path / "step").exists() and not list(tmp_path.glob(".step*"))


def test_a_corrupt_latest_falls_back_to_the_newest_good_checkpoint(make_config, tmp_path, capsys):
    checkpoints = CheckpointDir(tmp_path, KeepPolicy(checkpoint_every=2, keep_every=2))
    config = make_config(tmp_path)
    for step in (2, 4, 6):
        w = {"w": torch.full((4,), float(step))}
        checkpoints.save(step, unet=w, unet_ema=w, config=config, trainer={"step": step})
    assert checkpoints.resume_point().name == "step-000006"
    damaged = tmp_path / "step-000006" / "unet.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")
    (tmp_path / "step-000004" / CHECKSUMS).unlink()  # a half-written one, too
    assert checkpoints.resume_point().name == "step-000002"
    warning = capsys.readouterr().out
    assert "resuming from step-000002" in warning and "step-000006" in warning
    assert read_trainer_state(checkpoints.resume_point(), torch.device("cpu"))["step"] == 2


def test_the_trainer_state_is_read_without_unpickling(make_config, tmp_path):
    # An older checkpoint's trainer.pt (pickle) whose checksums match: loading it must not run
    # what it holds.
    checkpoints = CheckpointDir(tmp_path / "ckpt", KeepPolicy(checkpoint_every=1, keep_every=0))
    w = {"w": torch.zeros(2)}
    directory = checkpoints.save(1, unet=w, unet_ema=w, config=make_config(tmp_path))
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (directory / "trainer.pt").write_bytes(pickle.dumps({"step": Payload()}))
    _rechecksum(directory)
    with pytest.raises(CheckpointError, match="trainer.pt: not loaded"):
        read_trainer_state(directory, torch.device("cpu"))
    assert not marker.exists()
    # What sdpipe writes now is JSON + safetensors, and round-trips exactly.
    state = {
        "step": 3,
        "rng": [{"python": (3, (1, 2, 3), None), "torch": torch.get_rng_state()}],
        "optimizer": {"state": {0: {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": 0.1}]},
        "best_val_loss": float("inf"),
    }
    directory = checkpoints.save(2, unet=w, unet_ema=w, config=make_config(tmp_path), trainer=state)
    assert not list(directory.glob("*.pt"))
    back = read_trainer_state(directory, torch.device("cpu"))
    assert back["rng"][0]["python"] == (3, (1, 2, 3), None)
    assert torch.equal(back["rng"][0]["torch"], state["rng"][0]["torch"])
    assert torch.equal(
        back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )
    assert back["best_val_loss"] == float("inf") and back["step"] == 3


def _rechecksum(directory: Path) -> None:
    import hashlib
    import json

    digests = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.name != CHECKSUMS
    }
    (directory / CHECKSUMS).write_text(json.dumps(digests))


def test_final_is_replaced_with_no_moment_without_it(tmp_path):
    final = tmp_path / "final"
    seen_missing = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            if not (final / "unet.safetensors").is_file():
                seen_missing.append(1)

    for version in range(3):  # a first final/, then replacements while someone reads
        new = tmp_path / f".final.tmp-{version}"
        new.mkdir()
        (new / "unet.safetensors").write_text(str(version))
        if version == 1:
            watcher = threading.Thread(target=watch)
            watcher.start()
        for _ in range(200 if version else 1):
            replace_dir(new, final)
            new.mkdir()
            (new / "unet.safetensors").write_text(str(version))
        shutil.rmtree(new)
    done.set()
    watcher.join()
    assert seen_missing == []
    assert (final / "unet.safetensors").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_resume_on_another_phase_set_is_refused(make_config, phase_dir, tmp_path, monkeypatch):
    # The phase set was rebuilt between a crash and the rerun (other rows, same count): the
    # run must not "resume exactly" on other data.
    moved = tmp_path / "phase"
    shutil.copytree(phase_dir, moved, symlinks=True)
    config = make_config(tmp_path / "run", phase_dir=str(moved), max_steps=2)
    train(config)
    shutil.rmtree(tmp_path / "run" / "final")
    manifest = pq.read_table(moved / "manifest.parquet")
    pq.write_table(manifest.take(list(range(manifest.num_rows))[::-1]), moved / "manifest.parquet")
    with pytest.raises(CheckpointError, match=r"another phase set: .*manifest.parquet changed"):
        train(config)
