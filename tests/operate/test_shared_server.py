"""The shared server of docs/scale-out.md on loopback: Postgres, basic auth, two workers."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from flows.cli import broker, local

pytestmark = pytest.mark.slow


def _get(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_build_latents_demo_on_postgres(shared_stack, demo_run, pg):
    assert demo_run.state.is_completed(), demo_run.state.message
    from flows.loadtest import count_task_runs

    with shared_stack.settings():
        assert count_task_runs([demo_run.id]) >= 10
    # The run is in PostgreSQL, not in a SQLite file.
    sql = f"select count(*) from flow_run where id = '{demo_run.id}'"
    out = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "sdpipe", "-d", "prefect"]
        + ["-tAc", sql],
        capture_output=True,
        text=True,
    )
    if out.returncode == 0:  # psql is a client package of its own; the server check is enough
        assert out.stdout.strip() == "1"
    assert not list((shared_stack.root / ".prefect").glob("*.db"))
    # `sdpipe status` tells the same from the data root alone: every stage done, none failed.
    from flows.cli.status import status

    report = status(shared_stack.root, ["demo"])
    stages = {s["stage"]: s for s in report["sources"]["demo"]}
    assert stages["encode"]["done"] >= 2 and stages["encode"]["todo"] == 0
    assert not any(s["failed"] or s["running"] for s in stages.values())
    # One GPU pool limit per node: the node that encoded created its own, with 1 slot (no GPU).
    with shared_stack.client() as client:
        limits = {g.name: g.limit for g in client.read_global_concurrency_limits(limit=100)}
    assert {k: v for k, v in limits.items() if k.startswith("sdpipe-gpu-worker-")}
    assert set(limits.values()) == {1}


def test_auth_is_required(shared_stack, demo_run):
    url = shared_stack.api_url
    assert _get(f"{url}/health") == 200  # probes stay open
    assert _get(f"{url}/work_pools/sdpipe") == 401
    assert _get(f"{url}/work_pools/sdpipe", "sdpipe:wrong") == 401
    assert _get(f"{url}/work_pools/sdpipe", shared_stack.auth) == 200
    # The run above was picked up and completed by a worker holding the credentials.
    assert demo_run.state.is_completed()
    # A worker without them cannot even register with the server.
    env = local.prefect_env(shared_stack.root, shared_stack.port, {"PREFECT_API_AUTH_STRING": ""})
    env.pop("PREFECT_API_AUTH_STRING")
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "sdpipe", "--run-once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "401" in done.stdout + done.stderr


def test_one_run_split_across_two_workers(shared_stack):
    from flows import loadtest

    with shared_stack.settings():
        result = loadtest.load(shards=40, parts=2, data_root=str(shared_stack.root / "split"))
    assert [p["state"] for p in result["parts"]] == ["Completed", "Completed"]
    assert result["nodes"] == ["worker-a", "worker-b"]
    assert sum(p["done"] for p in result["parts"]) == 40
    # Every shard task run of both children is on the server (a parent with children).
    with shared_stack.client() as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[result["flow_run_id"]])
            )
        )
    assert len(children) == 2
    with shared_stack.settings():
        assert loadtest.wait_recorded([c.id for c in children], 40) == 40


def test_secrets_from_a_block_never_reach_the_logs(shared_stack):
    from prefect import flow, get_run_logger
    from prefect.blocks.system import Secret

    from flows.execution import credentials

    token = "hf_" + base64.b32encode(os.urandom(15)).decode().lower()
    saved = os.environ.pop("HF_TOKEN", None)
    try:
        with shared_stack.settings():
            Secret(value=token).save("hf-token", overwrite=True)

            @flow(name="secret-check")
            def uses_secret() -> list[str]:
                found = credentials.export_secrets()
                logger = get_run_logger()
                logger.info("token in use: %s", os.environ["HF_TOKEN"])
                try:
                    raise PermissionError(f"gated dataset refused token {token}")
                except PermissionError:
                    logger.exception("download failed")
                return found

            state = uses_secret(return_state=True)
            assert state.result() == ["HF_TOKEN"]
            assert os.environ["HF_TOKEN"] == token
            from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

            with shared_stack.client() as client:
                import time

                for _ in range(30):  # logs are sent in batches
                    logs = client.read_logs(
                        log_filter=LogFilter(
                            flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])
                        )
                    )
                    if any("download failed" in log.message for log in logs):
                        break
                    time.sleep(1)
        text = "\n".join(log.message for log in logs)
        assert "download failed" in text and credentials.MASK in text
        assert token not in text
    finally:
        os.environ.pop("HF_TOKEN", None)
        if saved is not None:
            os.environ["HF_TOKEN"] = saved


def test_a_server_restart_loses_no_task_run(shared_stack):
    """Runs last in this module: it restarts the shared server.

    Task-run states reach the server as events and wait in its message queue before they are
    written: in memory by default (a restart loses them, PostgreSQL or not), in a Redis stream
    with the prefect-redis broker, which the restarted server drains.
    """
    if not shared_stack.redis:
        pytest.skip(f"no Redis broker: {broker.unavailable_reason()}")
    from prefect.events.worker import EventsWorker

    from flows import loadtest

    shards = 300
    with shared_stack.settings():
        state = loadtest.load(shards=shards, plain=True, return_state=True)
        EventsWorker.drain_all(timeout=60)  # everything sent; the server may not have written it
        flow_run_id = state.state_details.flow_run_id
        shared_stack.restart_server()
        deadline = time.monotonic() + 180
        while (n := loadtest.count_task_runs([flow_run_id], "Completed")) < shards:
            assert time.monotonic() < deadline, f"{n} of {shards} task runs recorded"
            time.sleep(1)
    assert n == shards
