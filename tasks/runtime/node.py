"""One node as one process sees it: its worker budget, devices and GPU pool, resolved once, and
every process pool of the process, in one registry, living within the budget.

The budget is a budget: each CPU-heavy worker process (a downloader, a decode worker, a
tokenize process) lives under one of the node's `Slots`, so however many stages overlap, the
node runs at most `workers` of them plus EXTRA (each kind of pool gets one even when the others
hold every slot); a stage that runs alone may use them all. A flow builds its `Node` and passes
it to each stage function; on a Ray cluster each node's agent builds its own
(flows/execution/cluster_agents.py). The environment is read here, once, as a new process's
settings.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from tasks.runtime import concurrency

EXTRA = 2  # processes over the budget, at most: one per kind of pool that holds none
IDLE_S = 2.0  # an idle worker over its kind's floor share leaves to a kind below its share
POLL_S = 0.2  # a pool waiting for a slot looks this often whether it is closing


def local_gpus() -> int:
    """CUDA devices visible to this process (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_devices() -> list[str]:
    """This node's devices as `type:index`: `SDPIPE_DEVICES` (an entry without an index gets
    its position: `cpu,cpu` -> cpu:0, cpu:1), else every CUDA device, else `cpu:0`."""
    if value := os.environ.get("SDPIPE_DEVICES"):
        entries = [e.strip() for e in value.split(",") if e.strip()]
        return [e if ":" in e else f"{e}:{i}" for i, e in enumerate(entries)]
    return [f"cuda:{i}" for i in range(local_gpus())] or ["cpu:0"]


def gpu_pool() -> str:
    """The node's GPU pool: `SDPIPE_GPU_POOL`, else this host's name (one pool per node)."""
    return os.environ.get("SDPIPE_GPU_POOL") or socket.gethostname()


class Slots:
    """The node's CPU-heavy processes: `total` slots, shared by kinds of pool (a worker
    process holds one while it lives).

    A kind is granted a slot while fewer than `total` are held and it holds less than its
    share (`total` over the kinds that hold or want slots, rounded up), or, holding none, while
    fewer than `total + EXTRA` are: so every kind of work has a process, and never more than
    `total + EXTRA` live. A kind alone has all `total`. Holders give slots back to kinds that
    wait with less than their share (`should_yield`)."""

    def __init__(self, total: int):
        self.total = total
        self.held: Counter = Counter()
        self.waiting: Counter = Counter()
        self.peak = 0
        self.cond = threading.Condition()

    def _kinds(self, kind: str) -> int:
        return len(
            {k for k in self.held | self.waiting if self.held[k] or self.waiting[k]} | {kind}
        )

    def _grantable(self, kind: str) -> bool:
        used = sum(self.held.values())
        share = math.ceil(self.total / self._kinds(kind))
        if used < self.total and self.held[kind] < share:
            return True
        return self.held[kind] == 0 and used < self.total + EXTRA

    def acquire(self, kind: str, give_up: Callable[[], bool] | None = None) -> bool:
        """Wait for a slot of `kind`; False (none held) once `give_up()` says so (its pool
        closes), looked at every POLL_S."""
        with self.cond:
            self.waiting[kind] += 1
            try:
                while not self._grantable(kind):
                    if give_up is not None and give_up():
                        return False
                    self.cond.wait(POLL_S)
            finally:
                self.waiting[kind] -= 1
            self.held[kind] += 1
            self.peak = max(self.peak, sum(self.held.values()))
            self.cond.notify_all()  # the share of the kinds still waiting changed
            return True

    def release(self, kind: str) -> None:
        with self.cond:
            self.held[kind] -= 1
            self.cond.notify_all()

    def _floor(self, kind: str) -> int:
        return max(1, self.total // self._kinds(kind))

    def should_yield(self, kind: str, *, idle_s: float | None) -> bool:
        """Whether a holder of `kind` gives its slot back now (`idle_s`: how long it has had
        nothing to do; None: it is busy). To a kind that waits below its floor share (the
        budget over the kinds at work, rounded down, at least 1): at once when idle, after its
        request when it holds more than its own floor. To a kind that waits below its share:
        when idle for IDLE_S and over its floor. A worker can cost seconds of imports to start
        again, so a kind that has its floor takes nothing from a busy one."""
        with self.cond:
            others = [k for k, n in self.waiting.items() if n and k != kind]
            if not others:
                return False
            over = self.held[kind] > self._floor(kind)
            if any(self.held[k] < self._floor(k) for k in others):
                return idle_s is not None or over
            return over and idle_s is not None and idle_s >= IDLE_S

    def in_use(self) -> dict[str, int]:
        with self.cond:
            return {k: n for k, n in self.held.items() if n}


class _Closable(Protocol):
    def close(self) -> None: ...


P = TypeVar("P", bound=_Closable)


class Node:
    """This process's share of its node; see the module docstring.

    `workers`: the budget (the flow's parameter, else `SDPIPE_WORKERS`, else the cores this
    process may run on); `devices`: the node's devices for GPU stages (`node_devices`);
    `gpu_pool`: the GPU pool they belong to. `pool(kind, size, build)` is the process's pool
    of that kind and size, built once by `build(size, slots)` and kept for every later shard."""

    def __init__(self, workers: int | None = None, *, devices: list[str] | None = None):
        self.workers = concurrency.workers(workers)
        self.devices = devices if devices is not None else node_devices()
        self.gpu_pool = gpu_pool()
        self.slots = Slots(self.workers)
        self._pools: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Node(workers={self.workers}, devices={self.devices})"

    def pool(self, kind: str, size: int, build: Callable[[int, Slots], P]) -> P:
        """A kind has one pool per node: asked for another size (a setting changed between
        runs of a long-lived process), the older one finishes its queued work and closes
        first, else its idle workers would hold the slots the new one waits for."""
        with self._lock:
            if (kind, size) in self._pools:
                return self._pools[(kind, size)]
            older = [self._pools.pop(k) for k in list(self._pools) if k[0] == kind]
        for pool in older:
            pool.close()
        with self._lock:
            if (kind, size) not in self._pools:
                self._pools[(kind, size)] = build(size, self.slots)
            return self._pools[(kind, size)]

    def forget(self, kind: str, size: int, pool: Any) -> None:
        """Drop a pool that broke (the next use builds a new one)."""
        with self._lock:
            if self._pools.get((kind, size)) is pool:
                del self._pools[(kind, size)]

    def close(self) -> None:
        """Every pool's workers exit (and give their slots back)."""
        with self._lock:
            made = list(self._pools.values())
            self._pools.clear()
        for pool in made:
            pool.close()

    def in_process(self, n: int, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` in a worker process of the node's call pool of `n` (spawned
        interpreters: the caller may hold threads and a GPU), kept for later shards."""
        from tasks.runtime.calls import CallPool

        return self.pool("call", n, CallPool).call(fn, *args, **kwargs)


_nodes: dict[tuple[int, tuple[str, ...], str], Node] = {}
_nodes_lock = threading.Lock()


def local_node(workers: int | None = None) -> Node:
    """This process's node of budget `workers` (default: the process's setting, else its
    cores), built at first use and kept: what a stage function uses when no node is passed
    (a test, a command run on its own), and what a flow run or a cluster agent builds.

    A node is kept under everything that defines it (budget, devices, GPU pool): a process
    whose settings changed since (`SDPIPE_DEVICES` set for a later run) gets a node of its
    settings, and the one of the same budget and older settings closes its pools first (they
    would hold processes outside the new node's budget)."""
    budget = concurrency.workers(workers)
    key = (budget, tuple(node_devices()), gpu_pool())
    with _nodes_lock:
        if key in _nodes:
            return _nodes[key]
        older = [_nodes.pop(k) for k in list(_nodes) if k[0] == budget]
    for node in older:
        node.close()
    with _nodes_lock:
        if key not in _nodes:
            _nodes[key] = Node(budget, devices=list(key[1]))
        return _nodes[key]


@atexit.register
def close_nodes() -> None:
    """Every node of this process closes its pools (at exit; a multiprocessing child, which
    runs no atexit, calls it itself)."""
    with _nodes_lock:
        nodes = list(_nodes.values())
    for node in nodes:
        node.close()
