"""What orchestration costs per shard task, and whether the server records every task run.

Starts a throwaway PostgreSQL cluster and a Prefect server on it (basic auth on, as in
infra/docker-compose.yml), or a SQLite server with `--database sqlite` for comparison, then
runs the `sdpipe-load` flow in this process: `--shards` shard tasks through the real stage
path (flows/execution/stages.run_stage: named task runs, cache keys, persisted results, progress and
counts artifacts, 2 worker threads as build-latents) doing trivial work. After the flow
returns it waits until this process has sent every event (task run states travel as events),
then counts the task runs the server holds until they reach the number run (or `--wait`
seconds pass); `--restart` restarts the server before counting, which loses the task runs a
server had received but not yet written. Prints one JSON object.

Usage: python bench/orchestration.py --shards 1000 [--database postgres|sqlite] [--restart]
       [--broker memory|redis] [--plain] [--wait SECONDS]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import platform
import secrets
import shutil
import tempfile
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--database", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--restart", action="store_true", help="restart the server, then count")
    parser.add_argument(
        "--broker", choices=("memory", "redis"), default="memory", help="the server's messaging"
    )
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for records")
    parser.add_argument(
        "--plain", action="store_true", help="bare tasks (no cache, result, artifacts) instead"
    )
    args = parser.parse_args()

    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows import loadtest
    from flows.cli import broker, local, postgres
    from tasks.runtime.net import free_port

    work = Path(tempfile.mkdtemp(prefix="sdpipe-orch-"))
    root, port = work / "data", free_port()
    auth = f"bench:{secrets.token_urlsafe(9)}"
    pg = redis = None
    result: dict = {
        "shards": args.shards,
        "database": args.database,
        "broker": args.broker,
        "tasks": "plain" if args.plain else "stage",
    }
    try:
        server_env = {"PREFECT_SERVER_API_AUTH_STRING": auth, "PREFECT_API_AUTH_STRING": auth}
        if args.database == "postgres":
            if reason := postgres.unavailable_reason():
                print(json.dumps({**result, "skipped": reason}))
                return 0
            pg = postgres.Postgres().start()
            server_env["PREFECT_API_DATABASE_CONNECTION_URL"] = pg.create_database("prefect")
        if args.broker == "redis":
            if reason := broker.unavailable_reason():
                print(json.dumps({**result, "skipped": reason}))
                return 0
            redis = broker.Redis().start()
            server_env.update(redis.server_env())
        t = time.monotonic()
        local.ensure_server(root, port, env=server_env)
        result["server_start_seconds"] = round(time.monotonic() - t, 1)
        load_before = os.getloadavg()[0]
        with temporary_settings(
            {PREFECT_API_URL: local.api_url(port), PREFECT_API_AUTH_STRING: auth}
        ):
            t = time.monotonic()
            state = loadtest.load(
                shards=args.shards, data_root=str(root), plain=args.plain, return_state=True
            )
            seconds = time.monotonic() - t
            record = state.result()
            flow_run_id = state.state_details.flow_run_id
            # Wait until this process has sent every event (task run states travel as
            # events), so what follows measures the server alone.
            t = time.monotonic()
            EventsWorker.drain_all(timeout=args.wait)
            client_drain = time.monotonic() - t
            if args.restart:
                local.stop(root)
                local.ensure_server(root, port, env=server_env)
            t = time.monotonic()
            recorded = completed = 0
            while time.monotonic() - t < args.wait:
                recorded = loadtest.count_task_runs([flow_run_id])
                completed = loadtest.count_task_runs([flow_run_id], "Completed")
                if completed >= args.shards:
                    break
                time.sleep(1)
            lag = time.monotonic() - t
        result.update(
            {
                "seconds": round(seconds, 2),
                "overhead_per_task_ms": round(1000 * seconds / args.shards, 2),
                "tasks_run": record["done"],
                "tasks_failed": record["failed"],
                "task_runs_recorded": recorded,
                "task_runs_completed": completed,
                "client_drain_seconds": round(client_drain, 1),
                "record_lag_seconds": round(lag, 1),
                "lost": args.shards - completed,
                "restarted": args.restart,
                "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "python": platform.python_version(),
            }
        )
        print(json.dumps(result))
        return 0 if completed == args.shards == record["done"] else 1
    finally:
        local.stop(root)
        if pg is not None:
            pg.stop()
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
