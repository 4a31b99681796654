"""A local Prefect server and process worker for one data root, started only if not running.

Their state lives under `<root>/.prefect/` (SQLite database, logs, pid files), so each data
root has its own server; both are started in their own session and outlive the command that
started them, until `sdpipe stop`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
WORK_POOL = "sdpipe"


class LocalServerError(Exception):
    """The local Prefect server or worker could not be started."""


def prefect_dir(root: Path) -> Path:
    return root / ".prefect"


def api_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api"


def prefect_env(root: Path, port: int) -> dict[str, str]:
    """The environment of every Prefect command and flow run of this data root."""
    return {
        **os.environ,
        "PREFECT_HOME": str(prefect_dir(root)),
        "PREFECT_API_URL": api_url(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "SDPIPE_DATA": str(root),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"),
        # Pick up a new run within 2 s instead of the default 10 s: one machine, few runs.
        "PREFECT_WORKER_QUERY_SECONDS": os.environ.get("PREFECT_WORKER_QUERY_SECONDS", "2"),
    }


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def _start(name: str, command: list[str], root: Path, env: dict[str, str]) -> int:
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
    (prefect_dir(root) / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def ensure_server(root: Path, port: int, timeout_s: float = 120) -> bool:
    """Start the server unless one answers on `port`; returns True if this call started it."""
    url = api_url(port)
    if healthy(url):
        return False
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
        prefect_env(root, port),
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


def ensure_worker(root: Path, port: int) -> bool:
    """Start a process worker for the `sdpipe` pool unless this root's worker is running."""
    if _alive(prefect_dir(root) / "worker.pid"):
        return False
    env = prefect_env(root, port)
    _start(
        "worker",
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
        ],
        root,
        env,
    )
    return True


def prefect_cli(args: list[str], root: Path, port: int) -> subprocess.CompletedProcess:
    """Run `prefect <args>` from the project folder against this root's server."""
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=PROJECT_ROOT,
        env=prefect_env(root, port),
        text=True,
        capture_output=True,
    )


def deploy(root: Path, port: int) -> None:
    """Create the work pool if missing and register every deployment of prefect.yaml."""
    prefect_cli(["work-pool", "create", WORK_POOL, "--type", "process"], root, port)
    done = prefect_cli(["--no-prompt", "deploy", "--all"], root, port)
    if done.returncode != 0:
        raise LocalServerError(f"prefect deploy failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")


def stop(root: Path) -> list[str]:
    """Stop this root's worker and server; returns what was stopped."""
    stopped = []
    for name in ("worker", "server"):
        pid_file = prefect_dir(root) / f"{name}.pid"
        if _alive(pid_file):
            pid = int(pid_file.read_text())
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
