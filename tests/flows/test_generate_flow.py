"""`sdpipe generate` runs the generate flow: the batch waits for a slot of the node's GPU pool and
runs on the device that slot claims, never on one another holder has; artifacts show it."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import torch

from flows import cli
from flows.execution import pools
from tests.tasks.tiny_weights import write_tiny_weights

pytestmark = pytest.mark.slow


def read_artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=1
        )
        return artifact


def test_generate_command_runs_on_the_device_its_slot_claims(
    prefect_stack, tmp_path, monkeypatch, capsys
):
    from prefect.logging.handlers import APILogWorker

    monkeypatch.setenv("SDPIPE_DEVICES", "cpu,cpu")
    monkeypatch.setenv("SDPIPE_DEVICE_LOCKS", str(tmp_path / "locks"))
    monkeypatch.setenv("SDPIPE_GPU_POOL", f"generate-flow-{os.getpid()}")
    monkeypatch.delenv("SDPIPE_GPU_SLOTS", raising=False)
    root, _ = prefect_stack
    run_dir = write_tiny_weights(root / "runs" / "tiny-run")  # found by its run name
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two prompts\na red cat\na castle on a hill\n")
    out = tmp_path / "castles"
    argv = ["generate", str(prompts), "--weights", run_dir.name, "--per-prompt", "2"]
    argv += ["--out", str(out), "--steps", "3", "--devices", "1", "--seed", "10"]

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pools.claim_devices(1) as (taken,):  # another holder has the first device
            assert cli.main(["--data-root", str(root), *argv]) == 0
    finally:
        torch.set_num_threads(previous)
        APILogWorker.drain_all()  # this process's run logs, sent while the server is up

    index = pq.read_table(out / "index.parquet").to_pylist()
    assert [(r["prompt"], r["seed"]) for r in index] == [
        ("a red cat", 10), ("a red cat", 11), ("a castle on a hill", 10), ("a castle on a hill", 11)
    ]  # fmt: skip
    assert str(taken) == "cpu:0" and {r["device"] for r in index} == {"cpu:1"}
    assert all(r["weights"] == str(run_dir / "final") for r in index)
    printed = capsys.readouterr().out
    assert f"4 images (4 made, 0 already there) in {out}" in printed

    assert read_artifact("generate-castles-progress").data == 100.0
    summary = read_artifact("generate-castles-summary").data
    assert "4 images: 4 made now, 0 already there" in summary and "cpu:1 4" in summary
    assert "](data:image/jpeg;base64," in summary  # thumbnails the dashboard renders
