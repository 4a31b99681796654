"""`sdpipe stop` signals only the processes this data root started: a pid file whose pid now
belongs to another process (a reboot, a recycled pid) is not trusted."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from flows.cli import local


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_stop_leaves_a_process_that_reused_a_recorded_pid_alone(tmp_path):
    stranger = _sleeper()
    try:
        folder = local.prefect_dir(tmp_path)
        folder.mkdir(parents=True)
        started = psutil.Process(stranger.pid).create_time()
        # The pid is the stranger's, the start time is that of the process sdpipe started.
        (folder / "server.pid").write_text(
            json.dumps({"pid": stranger.pid, "started": started - 5})
        )
        # A pid file of an older sdpipe (the pid alone) naming a process that is not prefect.
        (folder / "worker.pid").write_text(str(stranger.pid))
        assert local.stop(tmp_path) == []
        assert stranger.poll() is None  # not signalled
        assert not (folder / "server.pid").exists() and not (folder / "worker.pid").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_stop_ends_what_it_started(tmp_path):
    local.prefect_dir(tmp_path).mkdir(parents=True)
    pid = local._start(
        "worker-x", [sys.executable, "-c", "import time; time.sleep(120)"], tmp_path, {}
    )
    pid_file = local.prefect_dir(tmp_path) / "worker-x.pid"
    assert json.loads(pid_file.read_text())["pid"] == pid and local._alive(pid_file)
    assert local.stop(tmp_path, only=("worker-x",)) == [f"worker-x (pid {pid})"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
