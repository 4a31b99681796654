"""The CLI's flow runs report to the data root's local server (the one `make demo` leaves
running, started as demo starts it when none is up), or to PREFECT_API_URL when set: never to
a throwaway server per command, which races its startup timeout on a busy machine and whose
runs no dashboard shows (issue 26, item 10). A server is the data root's only if the process
its pid file records listens on the recorded port: another service answering `/api/health`
on 4200 is never used (issue 33, item 8)."""

from __future__ import annotations

import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from flows.cli import commands as cli
from flows.cli import local
from tests.tasks.tiny_weights import write_tiny_weights


def _flow_run(port: int, out: Path):
    """The `generate` flow run that wrote into `out`, as the server at `port` lists it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: local.api_url(port)}),
        get_client(sync_client=True) as client,
    ):
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["generate"])), limit=200
        )
    return [r for r in runs if r.parameters.get("out_dir") == str(out)]


def _generate(root: Path, tmp_path: Path, name: str) -> tuple[list[str], Path]:
    run_dir = write_tiny_weights(root / "runs" / "cli-server")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n")
    out = tmp_path / name
    argv = ["--data-root", str(root), "generate", str(prompts), "--weights", str(run_dir)]
    argv += ["--per-prompt", "1", "--out", str(out), "--steps", "1", "--devices", "1"]
    return argv, out


def _run(argv: list[str]) -> int:
    from prefect.logging.handlers import APILogWorker

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cli.main(argv)
    finally:
        torch.set_num_threads(previous)
        APILogWorker.drain_all()


@pytest.fixture
def no_new_server(monkeypatch):
    """A server started here would outlive the test: the tests below need none."""

    def ensure_server(root, port, *args, **kwargs):
        raise AssertionError(f"a Prefect server was started for {root} on port {port}")

    monkeypatch.setattr(local, "ensure_server", ensure_server)


@pytest.fixture
def cpu_device(tmp_path, monkeypatch):
    monkeypatch.setenv("SDPIPE_DEVICES", "cpu")
    monkeypatch.setenv("SDPIPE_DEVICE_LOCKS", str(tmp_path / "locks"))
    monkeypatch.setenv("SDPIPE_GPU_POOL", f"cli-server-{os.getpid()}")
    monkeypatch.delenv("SDPIPE_GPU_SLOTS", raising=False)


@pytest.mark.slow
def test_without_an_api_url_the_run_goes_to_the_data_roots_server(
    prefect_stack, tmp_path, monkeypatch, cpu_device, no_new_server
):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    root, port = prefect_stack
    # The root's server is found by the port recorded when it started, not by a default port.
    assert local.running_server(root) == local.api_url(port)
    port_used, which = local.ensure_local_api(root)
    assert port_used == port and which.startswith(f"using the Prefect server of {root} on ")
    monkeypatch.setenv("SDPIPE_PREFECT_PORT", "9")  # nothing answers there
    # A user's shell: no API URL, and Prefect's home is the user's, not the data root's (a
    # throwaway server keeps its SQLite database there; under the root's it would write into
    # the root server's own database, and its runs would show there after all).
    home = tmp_path / "prefect-home"
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_HOME", str(home))
    argv, out = _generate(root, tmp_path, "no-api-url")
    with temporary_settings({PREFECT_HOME: home}, restore_defaults={PREFECT_API_URL}):
        assert PREFECT_API_URL.value() is None  # as a user's shell without the setting
        assert _run(argv) == 0
        assert "PREFECT_API_URL" not in os.environ  # set for the command only
    (run,) = _flow_run(port, out)
    assert run.state.is_completed()


@pytest.mark.slow
def test_with_an_api_url_the_run_goes_there_and_no_server_starts(
    prefect_stack, tmp_path, monkeypatch, cpu_device, no_new_server
):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _, port = prefect_stack
    other_root = tmp_path / "other-root"  # a data root without a server of its own
    monkeypatch.setenv("SDPIPE_PREFECT_PORT", "9")
    monkeypatch.setenv("PREFECT_API_URL", local.api_url(port))
    argv, out = _generate(other_root, tmp_path, "api-url")
    with temporary_settings({PREFECT_API_URL: local.api_url(port)}):  # as set in the shell
        assert _run(argv) == 0
    (run,) = _flow_run(port, out)
    assert run.state.is_completed()
    assert not (local.prefect_dir(other_root) / "server.pid").exists()


def test_without_a_server_the_cli_starts_the_data_roots_as_demo_does(tmp_path, monkeypatch, capsys):
    """No server for the root: one is started where `make demo` starts it, and outlives the
    command (here ensure_server is replaced: starting a real one is the session fixture's)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    started = []

    def ensure_server(root, port, timeout_s=120, env=None):
        started.append((root, port))
        return True

    monkeypatch.setattr(local, "ensure_server", ensure_server)
    monkeypatch.setenv("SDPIPE_PREFECT_PORT", "4321")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = tmp_path / "data"
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with cli.prefect_api(root) as url:
            assert url == "http://127.0.0.1:4321/api"
            assert PREFECT_API_URL.value() == url
            assert os.environ["PREFECT_API_URL"] == url  # and the processes the flow starts
        assert PREFECT_API_URL.value() is None
    assert "PREFECT_API_URL" not in os.environ
    assert started == [(root, 4321)]
    assert "started a Prefect server on http://127.0.0.1:4321/api" in capsys.readouterr().err


@pytest.fixture
def impostor():
    """The port of a plain loopback HTTP service that answers `/api/health` as Prefect does."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_service_on_the_port_is_not_used_the_roots_own_starts_on_a_free_one(
    tmp_path, monkeypatch, capsys, impostor
):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    started = []

    def ensure_server(root, port, timeout_s=120, env=None):
        started.append((root, port))
        return True

    monkeypatch.setattr(local, "ensure_server", ensure_server)
    monkeypatch.setenv("SDPIPE_PREFECT_PORT", str(impostor))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = tmp_path / "data"
    assert local.healthy(local.api_url(impostor))  # it passes the old check
    with temporary_settings(restore_defaults={PREFECT_API_URL}), cli.prefect_api(root) as url:
        ((_, port),) = started
        assert port != impostor and url == local.api_url(port)
    err = capsys.readouterr().err
    assert f"started a Prefect server on {url} for {root}" in err
    assert f"port {impostor} is another process's, left alone" in err


def test_the_command_says_it_uses_prefect_api_url(tmp_path, monkeypatch, capsys, no_new_server):
    url = "http://127.0.0.1:9/api"
    monkeypatch.setenv("PREFECT_API_URL", url)
    with cli.prefect_api(tmp_path) as used:
        assert used == url
    assert f"using the Prefect server at {url} (PREFECT_API_URL)" in capsys.readouterr().err


def test_the_server_is_not_started_on_a_port_another_process_answers_on(tmp_path, impostor):
    with pytest.raises(local.LocalServerError, match=f"port {impostor} is taken"):
        local.ensure_server(tmp_path, impostor)
    assert local.running_server(tmp_path) is None
    assert local.stop(tmp_path) == [] and local.healthy(local.api_url(impostor))


def test_a_recorded_server_is_the_roots_only_if_it_is_what_listens(tmp_path, impostor):
    """The process the root's pid file records is alive, but another process listens on the
    port recorded with it (the root's server could not bind it, or lost it): what answers there
    is not the root's server."""
    local.prefect_dir(tmp_path).mkdir(parents=True)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    pid = local._start("server", sleeper, tmp_path, {}, port=impostor)
    try:
        assert local._alive(local.prefect_dir(tmp_path) / "server.pid")
        assert local.running_server(tmp_path) is None
    finally:
        assert local.stop(tmp_path) == [f"server (pid {pid})"]
    assert local.healthy(local.api_url(impostor))  # the other service is left alone
