"""A GPU stage's device workers (flows/execution/devices.py) on two CPU twins: shards spread over
the devices, two stages (two flow runs) never hold one device at once, a failure costs only its
shard, a lane kept from its device gives its shards away, an idle worker gives its device back.

The claims here are the device locks alone (`pools.claim_devices`); the Prefect slot in front
of them (`pools.gpu_devices`) is tested in test_device_claims.py."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from flows.execution import pools
from flows.execution.devices import Devices, read_ahead


@pytest.fixture
def twins(monkeypatch, tmp_path):
    monkeypatch.setenv("SDPIPE_DEVICES", "cpu,cpu")
    monkeypatch.setenv("SDPIPE_DEVICE_LOCKS", str(tmp_path / "locks"))
    monkeypatch.setenv("SDPIPE_GPU_POOL", f"twins-{tmp_path.name}")


class Log:
    """What the workers did: (device, shard) served; (device, start, end) of each hold."""

    def __init__(self):
        self.lock = threading.Lock()
        self.served: list[tuple[str, str]] = []
        self.holds: list[tuple[str, float, float]] = []
        self.released: list[str] = []

    @contextlib.contextmanager
    def claim(self):
        with pools.claim_devices(1) as devices:
            start = time.monotonic()
            try:
                yield devices
            finally:
                with self.lock:
                    self.holds.append((str(devices[0]), start, time.monotonic()))

    def serve(self, seconds: float = 0.05, fail: set[str] = frozenset()):
        def serve(device, shards):
            for shard in shards:
                time.sleep(seconds)
                with self.lock:
                    self.served.append((str(device), shard))
                yield shard, (ValueError(f"bad {shard}") if shard in fail else f"{shard}@{device}")

        return serve

    def release(self, device) -> None:
        with self.lock:
            self.released.append(str(device))


def run_all(stage: Devices, shards: list[str]) -> dict[str, object]:
    futures = {s: stage.submit(s) for s in shards}
    out = {}
    for s, f in futures.items():
        try:
            out[s] = f.result(timeout=60)
        except Exception as e:
            out[s] = e
    return out


def test_shards_spread_over_both_devices_in_one_worker_each(twins):
    log = Log()
    with Devices("encode", log.serve(), claim=log.claim, release=log.release) as stage:
        assert len(stage) == 2  # a lane per device of the node
        out = run_all(stage, [f"{i:05d}" for i in range(6)])
    assert {str(v).split("@")[1] for v in out.values()} == {"cpu:0", "cpu:1"}
    by_device = {d: [s for dd, s in log.served if dd == d] for d in ("cpu:0", "cpu:1")}
    assert sorted(by_device["cpu:0"] + by_device["cpu:1"]) == sorted(out)
    assert min(len(v) for v in by_device.values()) >= 2  # dealt in turn (3 and 3 unless slow)
    assert len(log.holds) == 2  # one long-lived worker per device, not one per shard
    assert sorted(log.released) == ["cpu:0", "cpu:1"]  # each gave its device back at the end


def test_two_flow_runs_never_hold_one_device_at_once(twins):
    """Two stages (two flow runs' encoders, four lanes) on two devices: every shard is done,
    and the holds of each device never overlap."""
    log = Log()
    stages = [
        Devices(f"run{i}", log.serve(0.02), claim=log.claim, steal_after_s=0.5, idle_s=0.3)
        for i in range(2)
    ]
    results: dict[int, dict] = {}

    def drive(i: int) -> None:
        with stages[i]:
            results[i] = run_all(stages[i], [f"{i}-{s:02d}" for s in range(12)])

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(isinstance(v, str) for r in results.values() for v in r.values()), results
    assert sum(len(r) for r in results.values()) == 24
    for device in ("cpu:0", "cpu:1"):
        holds = sorted((s, e) for d, s, e in log.holds if d == device)
        for (_, end), (start, _) in zip(holds, holds[1:], strict=False):
            assert start >= end, f"{device} held twice at once: {holds}"


def test_a_failed_shard_costs_only_itself(twins):
    log = Log()
    with Devices("score", log.serve(fail={"00001"}), claim=log.claim) as stage:
        out = run_all(stage, ["00000", "00001", "00002", "00003"])
    assert isinstance(out["00001"], ValueError)
    assert [s for s, v in out.items() if isinstance(v, str)] == ["00000", "00002", "00003"]


def test_a_worker_that_cannot_start_fails_its_shards_instead_of_retrying_forever(twins):
    def broken(device, shards):
        raise RuntimeError("no model on " + str(device))
        yield  # a generator, as serve is

    log = Log()
    with Devices("encode", broken, claim=log.claim) as stage:
        out = run_all(stage, ["00000", "00001", "00002"])
    assert all(isinstance(v, RuntimeError) for v in out.values())


def test_a_lane_kept_from_its_device_gives_its_shards_away(twins):
    """Another holder has one of the two devices: the lane that waits for it hands its shards
    to the lane that has the other one, so none waits for the holder to finish."""
    log = Log()
    with pools.claim_devices(1) as (held,):  # another flow run's encoder
        with Devices("encode", log.serve(), claim=log.claim, steal_after_s=0.3) as stage:
            out = run_all(stage, [f"{i:05d}" for i in range(4)])
        free = "cpu:1" if str(held) == "cpu:0" else "cpu:0"
        assert {d for d, _ in log.served} == {free}
        assert len(out) == 4 and all(isinstance(v, str) for v in out.values())


def test_an_idle_worker_gives_its_device_back_and_a_new_one_starts(twins):
    log = Log()
    with Devices(
        "score", log.serve(), lanes=1, claim=log.claim, release=log.release, idle_s=0.2
    ) as stage:
        assert stage.run("00000").startswith("00000@")
        deadline = time.monotonic() + 10
        while not log.released and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(log.released) == 1 and stage.devices_in_use() == []
        assert stage.run("00001").startswith("00001@")
    assert len(log.holds) == 2


def test_read_ahead_warms_the_next_shard_while_one_is_worked_on():
    warmed: list[str] = []
    given = iter(["a", "b", "c"])
    seen = []
    for shard in read_ahead(given, warmed.append):
        time.sleep(0.2)  # working on it: the next one is warmed meanwhile
        seen.append((shard, list(warmed)))
    assert [s for s, _ in seen] == ["a", "b", "c"]
    assert seen[0][1] == ["a", "b"] and seen[1][1] == ["a", "b", "c"]
