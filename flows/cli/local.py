"""A local Prefect server and process worker for one data root, started only if not running.

Their state lives under `<root>/.prefect/` (SQLite database, logs, pid files), so each data
root has its own server; both are started in their own session and outlive the command that
started them, until `sdpipe stop`.

A data root uses a server only if it is its own: the process its `server.pid` names is alive
and is the one listening on the recorded port (`running_server`); anything else answering on
4200 is left alone and the root's own server starts on a free port.

The same functions start the shared setup of docs/scale-out.md on loopback (tests/operate,
bench/orchestration.py, infra/scale_out_local.py): `env` adds settings such as
`PREFECT_API_DATABASE_CONNECTION_URL` (Postgres) and the auth strings, and named workers
(`worker-a`, `worker-b`, ...) stand for the workers of several nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

from tasks.runtime.net import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]
WORK_POOL = "sdpipe"
DEFAULT_PORT = 4200  # of a data root's server, unless SDPIPE_PREFECT_PORT says otherwise
# Settings of the command that starts a worker which its flow runs must not take: `make demo`
# runs offline, but the worker it leaves running takes the user's next runs of the pool too.
# The demo's deployments set HF_HUB_OFFLINE in their own job variables (prefect.yaml).
CALLER_ONLY = ("HF_HUB_OFFLINE",)


class LocalServerError(Exception):
    """The local Prefect server or worker could not be started."""


def prefect_dir(root: Path) -> Path:
    return root / ".prefect"


def api_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api"


def prefect_env(root: Path, port: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every Prefect command and flow run of this data root (+ `env`)."""
    return {
        **os.environ,
        "PREFECT_HOME": str(prefect_dir(root)),
        "PREFECT_API_URL": api_url(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "SDPIPE_DATA": str(root),
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"),
        # Pick up a new run within 2 s instead of the default 10 s: one machine, few runs.
        "PREFECT_WORKER_QUERY_SECONDS": os.environ.get("PREFECT_WORKER_QUERY_SECONDS", "2"),
        **(env or {}),
    }


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _record(pid_file: Path) -> dict | None:
    """What a pid file records: pid, start time and, for a server, its port (older files
    hold the pid alone: {"pid": N}), or None."""
    try:
        text = pid_file.read_text().strip()
        record = json.loads(text) if text.startswith("{") else {"pid": text}
        record["pid"] = int(record["pid"])
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _recorded(pid_file: Path) -> tuple[int, float | None] | None:
    """(pid, start time) from a pid file (older files hold the pid alone), or None."""
    if (record := _record(pid_file)) is None:
        return None
    started = record.get("started")
    return record["pid"], None if started is None else float(started)


def _alive(pid_file: Path) -> bool:
    """Whether the process a pid file names is still the one this data root started: same pid
    and same start time (after a reboot or a long uptime the pid may be another process's),
    or, for pid files without a start time, a process that runs prefect."""
    recorded = _recorded(pid_file)
    if recorded is None:
        return False
    pid, started = recorded
    try:
        proc = psutil.Process(pid)
        if started is not None:
            return abs(proc.create_time() - started) < 0.01
        return any("prefect" in part for part in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _start(name: str, command: list[str], root: Path, env: dict[str, str], **record: object) -> int:
    log = prefect_dir(root) / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command,
            cwd=PROJECT_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    started = psutil.Process(proc.pid).create_time()
    (prefect_dir(root) / f"{name}.pid").write_text(
        json.dumps({"pid": proc.pid, "started": started, **record})
    )
    return proc.pid


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` (or a process it started) listens on `port`: it is the server
    answering there, not just alive while something else took the port."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return False
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
                    return True
    return False


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:`port` (a server can bind it, as uvicorn does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ensure_server(
    root: Path, port: int, timeout_s: float = 120, env: dict[str, str] | None = None
) -> bool:
    """Start this root's server on `port` unless it runs there; returns True if this call
    started it. Another process on the port is an error, whatever it answers: this root's runs
    must not go to a server it does not own (and `stop` would leave it running)."""
    url = api_url(port)
    if running_server(root) == url:
        return False
    if not port_free(port):
        raise LocalServerError(
            f"port {port} is taken by a process that is not the Prefect server of {root}"
        )
    prefect_dir(root).mkdir(parents=True, exist_ok=True)
    _start(
        "server",
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        root,
        prefect_env(root, port, env),
        port=port,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthy(url):
            return True
        if not _alive(prefect_dir(root) / "server.pid"):
            break
        time.sleep(0.5)
    log = prefect_dir(root) / "server.log"
    raise LocalServerError(f"the Prefect server did not start on {url}; see {log}")


def default_port() -> int:
    """Where `make demo` and the CLI start a data root's server: SDPIPE_PREFECT_PORT, else 4200
    (else a free port, when another process has that one)."""
    return int(os.environ.get("SDPIPE_PREFECT_PORT") or DEFAULT_PORT)


def running_server(root: Path) -> str | None:
    """The API URL of this data root's server, or None: the process `server.pid` records is
    alive, listens on the port recorded with it, and answers there."""
    pid_file = prefect_dir(root) / "server.pid"
    record = _record(pid_file)
    try:
        port = int(record["port"])
    except (TypeError, KeyError, ValueError):
        return None
    url = api_url(port)
    return url if _alive(pid_file) and _listens(record["pid"], port) and healthy(url) else None


def ensure_local_api(root: Path, timeout_s: float = 120) -> tuple[int, str]:
    """(port, a line saying which server that is) of the data root's own server: the one
    running for this root, else one started on `default_port()`, or on a free port when another
    process has that one. It outlives the command: one dashboard for every run of the root, and
    no throwaway server per command racing its startup timeout."""
    if url := running_server(root):
        record = _record(prefect_dir(root) / "server.pid")
        return int(
            record["port"]
        ), f"using the Prefect server of {root} on {url} (pid {record['pid']})"
    port, taken = default_port(), ""
    if not port_free(port):
        taken = f"; port {port} is another process's, left alone"
        port = free_port()
    ensure_server(root, port, timeout_s)
    url = api_url(port)
    return port, (
        f"started a Prefect server on {url} for {root} (dashboard {url.removesuffix('/api')}; "
        f"sdpipe stop stops it{taken})"
    )


@contextlib.contextmanager
def prefect_api(root: Path) -> Iterator[str]:
    """The Prefect API a command's flow runs report to: PREFECT_API_URL (or a Prefect
    profile's) when set, else the data root's own server (`ensure_local_api`), so every run
    shows on one dashboard and no throwaway server per command races its startup timeout.
    Says which on stderr; set for this process and the processes it starts, until the block
    ends."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # The environment first: Prefect's settings are read once, when it is first imported, and
    # miss a PREFECT_API_URL set after that (a test's session server, a wrapper script).
    if configured := os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value():
        print(f"using the Prefect server at {configured} (PREFECT_API_URL)", file=sys.stderr)
        yield configured
        return
    port, which = ensure_local_api(root)
    print(which, file=sys.stderr, flush=True)
    url = api_url(port)
    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            yield url
    finally:
        if saved is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = saved


def ensure_worker(
    root: Path,
    port: int,
    name: str = "worker",
    env: dict[str, str] | None = None,
    limit: int | None = None,
) -> bool:
    """Start a process worker for the `sdpipe` pool unless this root's worker `name` runs for
    the server on `port` (one that polls another port, a server since replaced, is stopped).

    `limit` caps the flow runs it runs at once (default: no cap). The worker does not take the
    caller's `CALLER_ONLY` settings (unless `env` gives them): its flow runs get their
    deployment's job variables over the worker's environment.
    """
    pid_file = prefect_dir(root) / f"{name}.pid"
    if _alive(pid_file):
        if _record(pid_file).get("port", port) == port:
            return False
        stop(root, only=(name,))
    prefect_dir(root).mkdir(parents=True, exist_ok=True)
    worker_env = {k: v for k, v in prefect_env(root, port).items() if k not in CALLER_ONLY}
    _start(
        name,
        [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            WORK_POOL,
            "--type",
            "process",
            "--name",
            f"{name}-{port}",
            *(["--limit", str(limit)] if limit else []),
        ],
        root,
        {**worker_env, **(env or {})},
        port=port,
    )
    return True


def prefect_cli(
    args: list[str], root: Path, port: int, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `prefect <args>` from the project folder against this root's server."""
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=PROJECT_ROOT,
        env=prefect_env(root, port, env),
        text=True,
        capture_output=True,
    )


def deploy(root: Path, port: int, env: dict[str, str] | None = None) -> None:
    """Create the work pool if missing and register every deployment of prefect.yaml."""
    prefect_cli(["work-pool", "create", WORK_POOL, "--type", "process"], root, port, env)
    done = prefect_cli(["--no-prompt", "deploy", "--all"], root, port, env)
    if done.returncode != 0:
        raise LocalServerError(f"prefect deploy failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")


def stop(root: Path, only: tuple[str, ...] | None = None) -> list[str]:
    """Stop this root's workers and server (or `only` these); returns what was stopped."""
    stopped = []
    workers = sorted(p.name[: -len(".pid")] for p in prefect_dir(root).glob("worker*.pid"))
    for name in only or (*workers, "server"):
        pid_file = prefect_dir(root) / f"{name}.pid"
        if _alive(pid_file):
            pid = _recorded(pid_file)[0]
            os.killpg(pid, signal.SIGTERM)
            for _ in range(100):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)  # reap it if this process started it
                if not _alive(pid_file):
                    break
                time.sleep(0.1)
            stopped.append(f"{name} (pid {pid})")
        pid_file.unlink(missing_ok=True)
    return stopped


def shared_env(port: int, auth_string: str | None) -> dict[str, str]:
    """What every client of a shared server sets: its URL and, with auth on, the credentials."""
    env = {"PREFECT_API_URL": api_url(port)}
    if auth_string:
        env["PREFECT_API_AUTH_STRING"] = auth_string
    return env


def start_shared(
    root: Path,
    port: int,
    *,
    database_url: str,
    auth_string: str | None,
    workers: tuple[str, ...] = ("worker-a", "worker-b"),
    worker_limit: int | None = 1,
    env: dict[str, str] | None = None,
    server_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """docs/scale-out.md on loopback: a server on Postgres with basic auth, the pool and every
    deployment, and one worker per (pretend) node; returns the clients' environment.

    Each worker gets `SDPIPE_NODE=<its name>` and `SDPIPE_GPU_POOL=<its name>` (one GPU pool
    per node, as on real nodes where the default is the host name). `server_env` adds server
    settings (e.g. flows.cli.broker.server_env(): Redis messaging).
    """
    client = {**(env or {}), **shared_env(port, auth_string)}
    ensure_server(root, port, env=shared_server_env(client, database_url, auth_string, server_env))
    deploy(root, port, env=client)
    for name in workers:
        node = {"SDPIPE_NODE": name, "SDPIPE_GPU_POOL": name}
        ensure_worker(root, port, name, env={**client, **node}, limit=worker_limit)
    return client


def shared_server_env(
    client: dict[str, str],
    database_url: str,
    auth_string: str | None,
    server_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """The shared server's settings: the clients' plus database, auth and `server_env`."""
    server = {**client, **(server_env or {}), "PREFECT_API_DATABASE_CONNECTION_URL": database_url}
    if auth_string:
        server["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    return server
