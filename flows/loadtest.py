"""sdpipe-load: many shard tasks that do trivial work, to measure what orchestration costs and
to check that a server records every task run; with `parts > 1`, one run split across workers.

Each shard goes through the same path as a real stage shard (flows/execution/stages.run_stage: one
named task run per shard, cache key, persisted result, progress and counts artifacts); only the
work is trivial. With `parts > 1` the run starts `parts` child runs of the deployment
`sdpipe-load/<deployment>` and waits for them: every idle worker of the pool takes one, so the
shards are split across the nodes. Each part records where it ran in `<root>/load/part-N.json`.
Used by bench/orchestration.py, infra/scale_out_local.py and tests/operate.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.execution.stages import run_stage
from tasks.runtime import shards as shard_io
from tasks.runtime.shards import ShardStats

FLOW_NAME = "sdpipe-load"
STAGE = "tokens"  # any per-shard stage name: only its display name and version are used


def node_name() -> str:
    """The node a worker stands for (SDPIPE_NODE, set per worker), else the host name."""
    return os.environ.get("SDPIPE_NODE") or socket.gethostname()


def _trivial(source: str, shard: str) -> ShardStats:
    return ShardStats(stage=STAGE, source=source, shard=shard, num_in=1, num_out=1)


@task(name="plain-shard", cache_policy=NO_CACHE, persist_result=False)
def plain_shard(i: int) -> int:
    return i


def run_plain(num_shards: int) -> dict:
    """A bare task per shard (no cache key, result, artifacts): Prefect's own floor."""
    futures = [plain_shard.submit(i) for i in range(num_shards)]
    done = sum(1 for f in futures if f.result() is not None)
    return {"part": 0, "node": node_name(), "done": done, "failed": num_shards - done}


def run_part(root: Path, part: int, num_shards: int) -> dict:
    source = f"load{part}"
    units = {f"{i:05d}": functools.partial(_trivial, source, f"{i:05d}") for i in range(num_shards)}
    start = time.monotonic()
    done, failed = run_stage(root, source, STAGE, units)
    record = {
        "part": part,
        "node": node_name(),
        "pid": os.getpid(),
        "done": len(done),
        "failed": len(failed),
        "seconds": round(time.monotonic() - start, 3),
    }
    shard_io.write_json_atomic(root / "load" / f"part-{part}.json", record)
    return record


def count_task_runs(flow_run_ids: list, state: str | None = None) -> int:
    """Task runs the server holds for these flow runs (in state `state`, if given)."""
    from prefect.client.orchestration import get_client

    body: dict = {"flow_runs": {"id": {"any_": [str(i) for i in flow_run_ids]}}}
    if state:
        body["task_runs"] = {"state": {"name": {"any_": [state]}}}
    with get_client(sync_client=True) as client:
        response = client._client.post("/task_runs/count", json=body)
        response.raise_for_status()
        return int(response.json())


def wait_recorded(flow_run_ids: list, expected: int, timeout_s: float = 120) -> int:
    """Completed task runs of these flow runs once the server holds `expected` of them, or
    what it holds at the timeout. The server writes task runs behind the flows that ran them
    (20-40 s behind a fast stage here): counting at once undercounts, nothing is lost."""
    deadline = time.monotonic() + timeout_s
    while (n := count_task_runs(flow_run_ids, "Completed")) < expected:
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    return n


def _wait(flow_run_ids: list, timeout_s: float) -> list:
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = [client.read_flow_run(i) for i in flow_run_ids]
            if all(r.state is not None and r.state.is_final() for r in runs):
                return runs
            if time.monotonic() > deadline:
                raise TimeoutError(f"child runs not finished after {timeout_s} s")
            time.sleep(1)


@flow(name=FLOW_NAME, task_runner=ThreadPoolTaskRunner(max_workers=2))
def load(
    shards: int = 100,
    parts: int = 1,
    part: int = 0,
    data_root: str | None = None,
    deployment: str = "loopback",
    timeout_s: float = 900,
    plain: bool = False,
) -> dict:
    """`shards` trivial shard tasks here, or split into `parts` child runs on the workers.

    `plain=True` runs bare tasks instead of the stage path, for comparison.
    """
    root = shard_io.data_root(data_root)
    if plain:
        return run_plain(shards)
    if parts <= 1:
        return run_part(root, part, shards)
    from prefect.deployments import run_deployment

    logger = get_run_logger()
    per_part = -(-shards // parts)
    children = [
        run_deployment(
            f"{FLOW_NAME}/{deployment}",
            parameters={
                "shards": min(per_part, shards - i * per_part),
                "parts": 1,
                "part": i,
                "data_root": str(root),
            },
            timeout=0,  # start them all, then wait
            as_subflow=True,
        )
        for i in range(parts)
    ]
    runs = _wait([c.id for c in children], timeout_s)
    records = []
    for i, r in enumerate(runs):
        path = root / "load" / f"part-{i}.json"
        record = json.loads(path.read_text()) if path.exists() else {"part": i}
        record["state"] = r.state.name
        records.append(record)
        logger.info("part %d: %s on %s", i, r.state.name, record.get("node"))
    from prefect.runtime import flow_run

    return {
        "flow_run_id": flow_run.id,
        "parts": records,
        "nodes": sorted({r.get("node") for r in records} - {None}),
    }


def deploy(name: str = "loopback", work_pool: str = "sdpipe") -> str:
    """Register `sdpipe-load/<name>` for the pool from this checkout; returns the deployment."""
    project = Path(__file__).resolve().parent.parent
    with contextlib.redirect_stdout(sys.stderr):  # its table is not part of a JSON result
        flow = load.from_source(
            source=str(project), entrypoint="flows/loadtest.py:load", _sync=True
        )
        flow.deploy(
            name=name,
            work_pool_name=work_pool,
            print_next_steps=False,
            ignore_warnings=True,
            _sync=True,
        )
    return f"{FLOW_NAME}/{name}"
