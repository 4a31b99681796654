"""A slot of the GPU pool names a device: holders in different processes get different devices,
a holder waits while all are taken, and a killed holder's device is free again."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from flows.execution import pools

HOLD = """
import sys
from flows.execution import pools
with pools.{claim} as claimed:
    print(*claimed if isinstance(claimed, list) else [claimed], flush=True)
    sys.stdin.readline()
"""


def test_devices_of_the_node(monkeypatch):
    monkeypatch.delenv("SDPIPE_GPU_SLOTS", raising=False)
    monkeypatch.setenv("SDPIPE_DEVICES", "cpu,cpu")
    assert pools.node_devices() == ["cpu:0", "cpu:1"]
    assert pools.gpu_slots() == 2  # the pool's slots default to the node's devices
    monkeypatch.setenv("SDPIPE_DEVICES", "cuda:2, cuda:5")
    assert pools.node_devices() == ["cuda:2", "cuda:5"]
    # Locks name physical GPUs: cuda:1 of a process that sees GPUs 4,6 is GPU 6 of the node.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert pools._lock_name("cuda:1") == "cuda-6.lock"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert pools._lock_name("cuda:1") == "cuda-1.lock"
    monkeypatch.delenv("SDPIPE_DEVICES")
    assert pools.node_devices() == ([f"cuda:{i}" for i in range(pools.local_gpus())] or ["cpu:0"])


def hold(claim: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLD.format(claim=claim)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def read_line(stream, timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline().strip() if ready else ""


def release(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.stdin.write("\n")
            p.stdin.flush()
    for p in procs:
        p.wait(timeout=30)


@pytest.fixture
def two_devices(tmp_path) -> dict[str, str]:
    return {
        "SDPIPE_DEVICES": "cpu,cpu",
        "SDPIPE_DEVICE_LOCKS": str(tmp_path / "locks"),
        "SDPIPE_GPU_POOL": f"claims-{os.getpid()}-{tmp_path.name}",
        "SDPIPE_GPU_SLOTS": "",
    }


def test_two_processes_claim_two_devices_and_a_third_waits(two_devices):
    a, b = hold("claim_devices(1)", two_devices), hold("claim_devices(1)", two_devices)
    waiting = None
    try:
        held_by_a, held_by_b = read_line(a.stdout, 60), read_line(b.stdout, 60)
        assert {held_by_a, held_by_b} == {"cpu:0", "cpu:1"}

        waiting = hold("claim_devices(1)", two_devices)
        # It has tried and found both taken (it says so), and holds nothing.
        deadline = time.monotonic() + 60
        while "waiting" not in (line := waiting.stderr.readline()) and time.monotonic() < deadline:
            assert line, "the third holder exited"
        assert read_line(waiting.stdout, 0.5) == ""

        # A holder killed outright frees its device: the waiting one gets exactly that one.
        a.send_signal(signal.SIGKILL)
        a.wait()
        assert read_line(waiting.stdout, 30) == held_by_a
    finally:
        for p in (a, b, waiting):
            if p is not None and p.poll() is None:
                release(p)


@pytest.mark.slow
def test_slot_holders_in_two_processes_get_different_devices(prefect_stack, two_devices):
    """gpu_device(): a slot of the pool's Prefect limit (created with one slot per device) and
    a device of its own, in two flow-run-like processes at once."""
    holders = [hold("gpu_device()", two_devices) for _ in range(2)]
    try:
        assert {read_line(h.stdout, 90) for h in holders} == {"cpu:0", "cpu:1"}
    finally:
        release(*holders)
    assert [h.returncode for h in holders] == [0, 0]
