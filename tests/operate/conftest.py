"""The shared setup of docs/scale-out.md on loopback, once per session: a throwaway PostgreSQL
cluster (Debian's `postgresql`), a Prefect server on it with basic auth on (and Redis as its
message broker where `redis-server` and prefect-redis are installed), the `sdpipe` pool with
every deployment, two process workers (`worker-a`, `worker-b`: two pretend nodes) and the
`sdpipe-load/loopback` deployment. Skipped, with the reason, where PostgreSQL cannot run.

The same code starts it in infra/scale_out_local.py and bench/orchestration.py
(flows.cli.postgres.Postgres + flows.cli.local.start_shared).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flows.cli import broker, local, postgres


@dataclass
class Stack:
    root: Path
    port: int
    auth: str
    env: dict[str, str]  # what a client sets: PREFECT_API_URL, PREFECT_API_AUTH_STRING
    server_env: dict[str, str]  # what the server was started with
    redis: bool  # Redis is the server's message broker

    def restart_server(self) -> None:
        local.stop(self.root, only=("server",))
        local.ensure_server(self.root, self.port, env=self.server_env)

    @property
    def api_url(self) -> str:
        return local.api_url(self.port)

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str):
        return local.prefect_cli(list(args), self.root, self.port, self.env)

    @contextlib.contextmanager
    def client(self):
        """A sync Prefect client of this server, with the credentials."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        with (
            temporary_settings({PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: self.auth}),
            get_client(sync_client=True) as client,
        ):
            yield client

    @contextlib.contextmanager
    def settings(self):
        """Flows called in this process report to this server."""
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        with temporary_settings(
            {PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: self.auth}
        ):
            yield

    def wait_final(self, flow_run_id, timeout_s: float = 300):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.client() as client:
                run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(1)
        raise TimeoutError(f"flow run {flow_run_id} not finished in {timeout_s} s")


@pytest.fixture(scope="session")
def pg():
    if reason := postgres.unavailable_reason():
        pytest.skip(f"PostgreSQL cannot run here: {reason}")
    with postgres.Postgres() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_broker():
    """A Redis for the server's messaging, or None where it cannot run (tests needing it skip)."""
    if broker.unavailable_reason():
        yield None
        return
    with broker.Redis() as r:
        yield r


@pytest.fixture(scope="session")
def shared_stack(pg, redis_broker, small_catalog, tmp_path_factory) -> Stack:
    from flows import loadtest
    from tasks.runtime.net import free_port

    root = tmp_path_factory.mktemp("shared-data")
    port = free_port()
    auth = f"sdpipe:{secrets.token_urlsafe(12)}"
    database_url = pg.create_database("prefect")
    broker_env = redis_broker.server_env() if redis_broker else {}
    env = local.start_shared(
        root,
        port,
        database_url=database_url,
        auth_string=auth,
        env={"SDPIPE_CATALOG": str(small_catalog), "SDPIPE_DATA": str(root)},
        server_env=broker_env,
    )
    server_env = local.shared_server_env(env, database_url, auth, broker_env)
    stack = Stack(root, port, auth, env, server_env, redis_broker is not None)
    try:
        with stack.settings():
            loadtest.deploy()
        yield stack
    finally:
        local.stop(root)


def _run_deployment(stack: Stack, name: str):
    run = stack.cli("deployment", "run", name, "--watch", "--watch-interval", "2")
    match = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout)
    assert match, run.stdout[-2000:] + run.stderr[-2000:]
    return stack.wait_final(match.group(1))


@pytest.fixture(scope="session")
def demo_run(shared_stack):
    """The build-latents/demo deployment run by a worker of the shared stack, finished."""
    return _run_deployment(shared_stack, "build-latents/demo")


@pytest.fixture(scope="session")
def demo_training(shared_stack, demo_run):
    """The curriculum/demo deployment (mix + 4 steps on 2 CPU ranks) after `demo_run`, finished."""
    return _run_deployment(shared_stack, "curriculum/demo")


@pytest.fixture
def out_dir(request, tmp_path) -> Path:
    """Where a test leaves files to look at: $SDPIPE_TEST_OUTPUT/<test>, else its tmp_path."""
    if base := os.environ.get("SDPIPE_TEST_OUTPUT"):
        d = Path(base) / request.node.name
        d.mkdir(parents=True, exist_ok=True)
        return d
    return tmp_path


CHROMIUM = "/usr/bin/chromium"
# As root, without a sandbox; no background connections (the machine's network is closed).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven by Playwright (its own browser download is not used).

    Module-scoped and asked for after the server fixtures: Playwright's sync API runs an event
    loop in this thread while it is open, which turns Prefect's sync calls into coroutines.
    """
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        except Exception as e:  # e.g. a Chromium too old for this Playwright
            pytest.skip(f"{CHROMIUM} did not start under Playwright: {e}")
        yield b
        b.close()
