"""Retrying a failed build-latents flow run re-executes only the shard that failed."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

from flows.cli import local
from tasks.latents import latent_keys
from tasks.runtime.shards import ShardStats

pytestmark = pytest.mark.slow


def _task_runs(flow_run_id: str, port: int) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: local.api_url(port)}),
        get_client(sync_client=True) as client,
    ):
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )


def _flow_run_state(flow_run_id: str, port: int):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: local.api_url(port)}),
        get_client(sync_client=True) as client,
    ):
        return client.read_flow_run(flow_run_id).state


def _wait_terminal(flow_run_id: str, port: int, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _flow_run_state(flow_run_id, port)
        if state is not None and state.is_final() and state.name != "Scheduled":
            return state
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout_s} s")


def _executed_and_cached(task_runs: list, attempt: int) -> tuple[set[str], set[str]]:
    mine = [t for t in task_runs if t.flow_run_run_count == attempt]
    executed = {t.name for t in mine if t.state and t.state.name == "Completed"}
    cached = {t.name for t in mine if t.state and t.state.name == "Cached"}
    return executed, cached


def _outputs_of_others(latents: Path, failed: str) -> dict[str, int]:
    """mtime of every file of every shard but `failed` under latents/."""
    return {
        p.name: p.stat().st_mtime_ns
        for p in latents.glob("[0-9][0-9][0-9][0-9][0-9].*")
        if p.is_file() and not p.name.startswith(f"{failed}.")
    }


def test_retry_reruns_only_the_failed_shard(prefect_stack):
    root, port = prefect_stack
    latents = root / "demo" / "latents"
    # A real fault: a directory squats on shard 00001's keys file (an output of every layout,
    # legacy or bucketed, whatever buckets the shard has), so its rename fails.
    blocker = latent_keys.path(root, "demo", "00001")
    blocker.mkdir(parents=True)

    run = local.prefect_cli(
        ["deployment", "run", "build-latents/demo", "--watch", "--watch-interval", "1"], root, port
    )
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)
    state = _flow_run_state(flow_run_id, port)
    assert state.is_failed(), run.stdout[-2000:]
    assert "encode-demo-00001" in state.message

    first_executed, _ = _executed_and_cached(_task_runs(flow_run_id, port), 1)
    assert "encode-demo-00000" in first_executed and "fetch-images-demo-00000" in first_executed
    # Every output of the shards that were done (latents of each bucket, keys, record); the
    # failed shard's own files (bucket files written before its keys file failed) are redone.
    done_before = _outputs_of_others(latents, failed="00001")
    assert not (latents / "00001.stats.json").exists()
    assert {p.split(".")[0] for p in done_before if p.endswith(".stats.json")} >= {"00000"}
    assert len([p for p in done_before if p.endswith(".npy")]) >= 2

    blocker.rmdir()
    retry = local.prefect_cli(["flow-run", "retry", flow_run_id], root, port)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    state = _wait_terminal(flow_run_id, port)
    assert state.is_completed(), state.message

    executed, cached = _executed_and_cached(_task_runs(flow_run_id, port), 2)
    assert executed == {"encode-demo-00001"}
    assert {
        "fetch-metadata-demo-00000",
        "filter-demo-all",
        "fetch-images-demo-00000",
        "filter-pixels-demo-all",
        "tokenize-demo-00001",
        "encode-demo-00000",
    } <= cached
    # The other shards' outputs were not rewritten; the failed one now exists.
    assert _outputs_of_others(latents, failed="00001") == done_before
    record = ShardStats.read(latents / "00001.stats.json")
    assert record.num_out > 0 and latent_keys.read(root, "demo", "00001").num_rows == record.num_out
    spec = record.extra["latent_spec"]
    if record.extra.get("buckets"):  # the catalog's layout: one file per bucket of the shard
        buckets = record.extra["buckets"]
        assert sorted(p.name for p in latents.glob("00001.*.npy")) == sorted(
            f"00001.{b}.npy" for b in buckets
        )
        for b, n in buckets.items():
            z = np.load(latent_keys.latents_path(root, "demo", "00001", b), mmap_mode="r")
            assert z.shape[:3] == (n, spec["views"], spec["channels"])
    else:
        assert np.load(latents / "00001.npy").shape[0] == record.num_out
    assert not [p for p in Path(root).rglob("*") if ".tmp-" in p.name]
