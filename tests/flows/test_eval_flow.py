"""`sdpipe eval` runs the eval flow: the table and grid artifacts on the server, TensorBoard
scalars per metric and category, FID against a reference folder, and with --checkpoints the best
checkpoint by the eval set's metric linked; a curriculum whose eval networks are missing fails
before it trains."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from flows import cli
from flows.cli.local import PROJECT_ROOT
from sdtrain.config import TrainConfig
from tasks.evaluation import evaluate
from tests.image_sources import markdown_sources, not_embedded
from tests.tasks import eval_data
from tests.tasks.conftest import scene_jpeg


def read_artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=1
        )
        return artifact


def test_a_curriculum_without_its_eval_weights_fails_before_training(tmp_path):
    env = {**os.environ, "SDPIPE_WEIGHTS": str(tmp_path / "no-weights")}
    env.pop("SDPIPE_CATALOG", None)
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "--data-root", str(tmp_path), "curriculum", "phase-1"],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "vit_large_patch14_clip_224.openai.bin" in err[0]
    assert 'eval_set: "" trains it without' in err[0]
    assert not (tmp_path / "phases").exists()  # nothing was mixed, nothing trained


@pytest.mark.slow
def test_eval_command_publishes_table_grid_scalars_and_the_checkpoint_choice(
    prefect_stack, tmp_path, monkeypatch, capsys
):
    from prefect.logging.handlers import APILogWorker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("SDPIPE_DEVICE_LOCKS", str(tmp_path / "locks"))
    monkeypatch.setenv("SDPIPE_GPU_POOL", f"eval-flow-{os.getpid()}")
    root = eval_data.write_eval_root(tmp_path / "data")
    checkpoints = evaluate.run_checkpoints(root, "demo")
    other = eval_data.write_weights(tmp_path / "other", root / "phases" / "demo", seed_offset=30)
    checkpoints.save(
        3,
        unet=load_file(str(other / "unet.safetensors")),
        unet_ema=load_file(str(other / "unet_ema.safetensors")),
        config=TrainConfig.from_json(other / "config.json"),
    )
    reference = tmp_path / "coco-like"
    reference.mkdir()
    for i in range(4):  # photos are rarely square: each is cut to its centered square
        image = Image.open(io.BytesIO(scene_jpeg(200 + i, side=160)))
        image.crop((0, 0, 160, 120)).save(reference / f"{i}.jpg")

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    argv = ["--data-root", str(root), "eval", "--phase", "demo", "--checkpoints"]
    try:
        assert cli.main([*argv, "--reference", str(reference), "--devices", "1"]) == 0
    finally:
        torch.set_num_threads(previous)
        APILogWorker.drain_all()
    out = capsys.readouterr().out
    assert "eval demo on demo: 9 images" in out and "fid_reference" in out

    summary = json.loads((root / "runs" / "demo" / "eval" / evaluate.SUMMARY).read_text())
    assert summary["fid"]["num_reference"] == 4 and summary["metrics"]["all"]["fid_reference"]
    assert len(list((root / ".cache" / "fid").glob("*.npz"))) == 1  # reused by the next eval

    table = read_artifact("demo-eval-table")
    assert table.type == "table"
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [r["category"] for r in rows][-1] == "all" and len(rows) == 10
    grid = read_artifact("demo-eval-grid").data
    sources = markdown_sources(grid)
    assert len(sources) == 9 + 1 and not_embedded(sources) == []  # categories + the pairs
    assert "Checkpoint choice by clip_score" in grid and len(grid.encode()) < 1_000_000

    choice = json.loads((root / "runs" / "demo" / "eval" / evaluate.CHOICE).read_text())
    assert [c["name"] for c in choice["candidates"]] == ["final", "step-000003"]
    candidate = root / "runs" / "demo" / "eval" / "checkpoints" / "step-000003"
    assert (candidate / evaluate.SUMMARY).is_file()
    chosen = choice["chosen"]
    assert chosen["value"] == max(c["value"] for c in choice["candidates"])
    if chosen["name"] == "step-000003":
        assert checkpoints.best("clip_score") == checkpoints.step_dir(3).resolve()

    events = EventAccumulator(str(root / "runs" / "demo" / "tensorboard" / "eval")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/clip_score/forest", "eval/fid/all", "eval/val_loss_high/all"} <= tags
    (value,) = events.Scalars("eval/clip_score/forest")
    assert value.value == pytest.approx(summary["metrics"]["forest"]["clip_score"], rel=1e-6)
