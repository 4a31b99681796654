"""Retrying a failed build-latents flow run re-executes only the shard that failed."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from flows import local

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


def outputs(latents: Path, but: str) -> dict[str, int]:
    """mtime of each shard's latents files (`NNNNN.npy`, or `NNNNN.WxH.npy` per bucket) and
    keys file, but those of shard `but`."""
    return {
        p.name: p.stat().st_mtime_ns
        for p in latents.glob("[0-9]*")
        if p.is_file() and p.name.endswith((".npy", ".keys.arrow"))
        if not p.name.startswith(f"{but}.")
    }


def test_retry_reruns_only_the_failed_shard(prefect_stack):
    root, port = prefect_stack
    latents = root / "demo" / "latents"
    # A real fault: a directory squats on shard 00001's keys file, so its rename fails (in
    # either layout, the last output written before the record: after its latents files).
    blocker = latents / "00001.keys.arrow"
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
    done_before = outputs(latents, but="00001")
    assert not (latents / "00001.stats.json").exists()
    assert len({name.split(".")[0] for name in done_before}) >= 2

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
    assert outputs(latents, but="00001") == done_before
    assert (latents / "00001.keys.arrow").is_file() and (latents / "00001.stats.json").is_file()
    assert list(latents.glob("00001*.npy"))
    assert not [p for p in Path(root).rglob("*") if ".tmp-" in p.name]
