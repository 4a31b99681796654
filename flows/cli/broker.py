"""Redis as the Prefect server's message broker, so a server restart loses no task run.

The server receives task-run states as events and writes them from an in-memory queue: a
restart loses what is queued, PostgreSQL or not (bench/orchestration.py measured it, see
docs/benchmarks.md). With the `prefect-redis` broker the queue is a Redis stream that outlives
the server process, and the restarted server writes the rest. `server_env()` are the server's
settings for it; `Redis` is a throwaway Debian `redis-server` on loopback for the benchmark
(infra/docker-compose.yml runs the `redis` service instead).
"""

from __future__ import annotations

import shutil
import subprocess
import time

from flows.cli.loopback_server import LoopbackServer


def server_env(host: str, port: int, db: int = 0) -> dict[str, str]:
    """Settings of a Prefect server that uses Redis for messaging, caches and leases."""
    return {
        "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
        "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
        "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_REDIS_MESSAGING_HOST": host,
        "PREFECT_REDIS_MESSAGING_PORT": str(port),
        "PREFECT_REDIS_MESSAGING_DB": str(db),
    }


def unavailable_reason() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server not found (apt-get install redis-server)"
    try:
        import prefect_redis  # noqa: F401
    except ImportError:
        return "prefect-redis is not installed (pip install prefect-redis)"
    return None


class Redis(LoopbackServer):
    """`with Redis() as r: r.server_env()` — a started redis-server, removed on exit."""

    folder_prefix = "sdpipe-redis-"
    unavailable_reason = staticmethod(unavailable_reason)
    proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir"]
            + [str(self.dir), "--save", "", "--appendonly", "no"],
            stdout=open(self.dir / "redis.log", "wb"),  # noqa: SIM115 (closed with the process)
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if "Ready to accept connections" in (self.dir / "redis.log").read_text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"redis-server did not start: {(self.dir / 'redis.log').read_text()}")

    def server_env(self) -> dict[str, str]:
        return server_env("127.0.0.1", self.port)

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
