"""The node's worker budget is a budget: the CPU-heavy processes of overlapping stages stay
within `workers` + EXTRA, a stage alone has them all, and every stage gets on."""

from __future__ import annotations

import os
import threading
import time

from tasks.latents import images
from tasks.runtime.calls import CallPool
from tasks.runtime.node import EXTRA, Node, Slots


def test_kinds_share_the_slots_and_a_kind_alone_has_them_all():
    slots = Slots(4)
    for _ in range(4):
        slots.acquire("fetch")  # alone: the whole budget
    assert slots.in_use() == {"fetch": 4}
    got = []
    waiters = [
        threading.Thread(target=lambda k=k: (slots.acquire(k), got.append(k)))
        for k in ("decode", "tokenize", "encode")
    ]
    for t in waiters:
        t.start()
    time.sleep(0.2)
    # Every kind holding none gets one, up to EXTRA over the budget; the third waits.
    assert sum(slots.in_use().values()) == 4 + EXTRA and len(got) == EXTRA
    # Over its floor share while a kind with none waits: it gives one back after its request.
    assert slots.should_yield("fetch", idle_s=None)
    slots.release("fetch")
    for t in waiters:
        t.join(timeout=5)
    assert sorted(got) == ["decode", "encode", "tokenize"]
    assert slots.peak == 4 + EXTRA


def _sleep_and_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_overlapping_pools_stay_within_the_budget_and_all_finish(tmp_path):
    """Three kinds of pool of one node at workers=2, each sized to the whole budget and fed at
    once: at most 2 + EXTRA worker processes live, and every request is answered."""
    node = Node(2)
    calls = node.pool("call", 2, CallPool)
    decode = images.shared_pool(node)
    other = node.pool(
        "encode-decode", 2, lambda n, slots: images.DecodePool(n, slots=slots, kind="encode")
    )
    live: list[int] = []
    stop = threading.Event()
    import psutil

    before = {c.pid for c in psutil.Process().children()}

    def count() -> None:
        import psutil

        me = psutil.Process()
        while not stop.is_set():
            # Only this node's workers: other tests of this process may keep pools of theirs.
            live.append(len({c.pid for c in me.children()} - before))
            time.sleep(0.02)

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    try:
        pids = [calls.submit(_sleep_and_pid, 0.2) for _ in range(6)]
        decoded = [decode.submit([], 8) for _ in range(20)] + [
            other.submit([], 8) for _ in range(20)
        ]
        assert all(f.result(timeout=120) for f in pids)
        assert all(f.result(timeout=120)[0] == [] for f in decoded)
    finally:
        stop.set()
        counter.join()
        node.close()
    assert max(live) <= 2 + EXTRA, max(live)
    assert node.slots.peak <= 2 + EXTRA
    assert node.slots.in_use() == {}  # closed: every slot back


def test_a_pool_closes_while_its_lanes_wait_for_slots():
    """A pool whose lanes wait for slots other kinds hold still closes (its lanes give up)."""
    node = Node(1)
    for kind in ("a", "b", "c")[: 1 + EXTRA]:  # every slot held, by other kinds
        node.slots.acquire(kind)
    pool = images.shared_pool(node)
    pending = pool.submit([], 8)  # a lane now waits for a slot
    time.sleep(0.3)
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert pending.cancelled()  # not left waiting


def test_a_pool_of_another_size_replaces_the_kinds_older_one():
    """A long-lived process whose setting changed between runs: the kind's older pool, its
    idle workers holding every slot, closes instead of leaving the new one waiting forever."""
    node = Node(2)
    try:
        first = node.pool("call", 2, CallPool)
        running = [first.submit(_sleep_and_pid, 0.5) for _ in range(2)]
        assert len({f.result(timeout=120) for f in running}) == 2  # both workers hold a slot
        second = node.pool("call", 1, CallPool)
        assert second.submit(_sleep_and_pid, 0.1).result(timeout=60)
        assert node.slots.in_use() == {"call": 1}
    finally:
        node.close()


def test_a_process_whose_device_setting_changed_gets_a_node_of_its_settings(monkeypatch):
    """A node built before `SDPIPE_DEVICES` was set (an earlier run in the same process) is not
    handed to a later run that names two devices: that run's GPU stages would use one (CI saw
    it: `devices cpu:0` with `SDPIPE_DEVICES=cpu,cpu`). The older node of that budget closes."""
    from tasks.runtime.node import local_node

    monkeypatch.delenv("SDPIPE_DEVICES", raising=False)
    monkeypatch.setenv("SDPIPE_GPU_POOL", f"node-test-{os.getpid()}")
    before = local_node(3)
    assert local_node(3) is before
    monkeypatch.setenv("SDPIPE_DEVICES", "cpu,cpu")
    after = local_node(3)
    assert after is not before
    assert after.devices == ["cpu:0", "cpu:1"]
    assert local_node(3) is after
