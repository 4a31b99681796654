"""docs/scale-out.md followed step by step on one machine, over loopback.

Step 1 PostgreSQL (and Redis, where redis-server and prefect-redis are installed), step 2 the
server on them with basic auth, step 3 the pool, the deployments
and the GPU pool limits, step 4 one worker per node (two pretend nodes here), step 5 a
build-latents run on a worker, step 6 one run split across the two workers. Prints one JSON
object; exits 1 if a step's check fails. What this machine cannot do (GPUs, other hosts, the
Docker engine) is not attempted; the page says what changes there.

Usage: python infra/scale_out_local.py [--shards 40] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


def step(n: int, text: str) -> None:
    print(f"step {n}: {text}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=40, help="shards of the split run")
    parser.add_argument("--keep", action="store_true", help="leave everything running")
    args = parser.parse_args()

    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows import loadtest
    from flows.cli import broker, local, postgres
    from flows.execution.pools import gpu_limit_name
    from tasks.runtime.net import free_port

    if reason := postgres.unavailable_reason():
        print(json.dumps({"skipped": reason}))
        return 0
    work = Path(tempfile.mkdtemp(prefix="sdpipe-scale-out-"))
    root, port = work / "data", free_port()
    auth = f"sdpipe:{secrets.token_urlsafe(12)}"  # in .env on a real server, never in the repo
    result: dict = {"data_root": str(root), "api_url": local.api_url(port)}
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    pg = postgres.Postgres()
    redis = None if broker.unavailable_reason() else broker.Redis()
    try:
        step(1, "PostgreSQL and Redis for the server (compose: `postgres`, `redis`)")
        pg.start()
        db_url = pg.create_database("prefect")
        broker_env = redis.start().server_env() if redis else {}
        result["broker"] = "redis" if redis else f"memory ({broker.unavailable_reason()})"
        timings["postgres"] = time.monotonic() - t0

        step(2, "the server on PostgreSQL, basic auth on; 3: pool + deployments; 4: workers")
        env = local.start_shared(
            root, port, database_url=db_url, auth_string=auth, server_env=broker_env
        )
        timings["server_pool_deploy_workers"] = time.monotonic() - t0 - timings["postgres"]
        # Step 3, the part `start_shared` leaves to the operator: the GPU pool limits, one per
        # node (created on first use otherwise) and the load-test deployment of step 6.
        for node in ("worker-a", "worker-b"):
            done = local.prefect_cli(
                ["gcl", "create", gpu_limit_name(node), "--limit", "1"], root, port, env
            )
            assert done.returncode == 0, done.stdout + done.stderr
        settings = temporary_settings(
            {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: auth}
        )
        settings.__enter__()
        loadtest.deploy()

        step(5, "prefect deployment run build-latents/demo, picked up by a worker")
        t = time.monotonic()
        run = local.prefect_cli(
            ["deployment", "run", "build-latents/demo", "--watch", "--watch-interval", "2"],
            root,
            port,
            env,
        )
        match = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout)
        ok = match is not None and "Completed" in run.stdout
        result["build_latents_demo"] = "Completed" if ok else run.stdout[-1500:]
        timings["build_latents_demo"] = time.monotonic() - t

        step(6, f"one run of {args.shards} shards split across the two workers")
        t = time.monotonic()
        split = loadtest.load(shards=args.shards, parts=2, data_root=str(root))
        timings["split_run"] = time.monotonic() - t
        result["split_run"] = split
        ok = ok and split["nodes"] == ["worker-a", "worker-b"]
        ok = ok and sum(p.get("done", 0) for p in split["parts"]) == args.shards
        result["ok"] = ok
        result["seconds"] = {k: round(v, 1) for k, v in timings.items()}
        print(json.dumps(result, indent=1))
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"left running: {local.api_url(port)} (auth {auth}); postgres {pg.url()}")
        else:
            local.stop(root)
            pg.stop()
            if redis:
                redis.stop()
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
