"""What a cluster's nodes get from the process that starts their actors (build agents, training
launchers, encode and generation workers): one rule for all of them (`net.node_env`, and the
flows' `forwarded_env` with the Prefect API of the active profile)."""

from __future__ import annotations

import os
from pathlib import Path

from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.execution.cluster import forwarded_env
from tasks.runtime.net import PROJECT_ROOT, node_env


def test_settings_reach_the_nodes_with_paths_absolute_and_node_own_ones_left(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith(("SDPIPE_", "HF_", "WANDB_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SDPIPE_DATA", "data")
    monkeypatch.setenv("SDPIPE_SEMANTIC_TEMP", "/scratch/semantic")  # a setting no list named
    monkeypatch.setenv("HF_HOME", "cache/hf")
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    for own in ("SDPIPE_WORKERS", "SDPIPE_NODE", "SDPIPE_DEVICES", "SDPIPE_GPU_SLOTS"):
        monkeypatch.setenv(own, "7")
    env = node_env()
    assert env["SDPIPE_DATA"] == str(tmp_path / "data")
    assert env["SDPIPE_SEMANTIC_TEMP"] == "/scratch/semantic"
    assert env["HF_HOME"] == str(tmp_path / "cache" / "hf")
    assert env["WANDB_API_KEY"] == "secret"
    # The weights folder as this process resolves it (./weights here), not an actor's ./weights.
    assert env["SDPIPE_WEIGHTS"] == str(tmp_path / "weights")
    assert not {"SDPIPE_WORKERS", "SDPIPE_NODE", "SDPIPE_DEVICES", "SDPIPE_GPU_SLOTS"} & set(env)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(PROJECT_ROOT)
    monkeypatch.setenv("SDPIPE_WEIGHTS", "w")
    assert node_env()["SDPIPE_WEIGHTS"] == str(Path(tmp_path, "w"))


def test_the_prefect_api_of_a_profile_reaches_the_nodes(monkeypatch):
    # A profile's API URL (not in the environment) is where the ranks and agents report too.
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_API_URL: "http://10.0.0.5:4200/api"}):
        assert "PREFECT_API_URL" not in os.environ
        assert forwarded_env()["PREFECT_API_URL"] == "http://10.0.0.5:4200/api"


def test_the_ray_token_stays_off_the_nodes_runtime_env(monkeypatch, tmp_path):
    # A node has the cluster's token from its own environment (`ray start` there); an actor's
    # runtime_env is kept in the cluster's metadata, where anyone who can list jobs reads it.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    env = forwarded_env()
    assert not [k for k in env if k.startswith("RAY_")]
    assert "the-token" not in env.values()
