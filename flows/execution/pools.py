"""GPU pools: one Prefect global concurrency limit per pool of GPUs, held by score, encode and
train work so they never oversubscribe the GPUs, however many flow runs the workers start.

Settings (environment of the worker, hence of every flow run it starts):
- `SDPIPE_GPU_POOL`: the pool's name (default: this host's name, i.e. one pool per node).
- `SDPIPE_GPU_SLOTS`: the limit's slots when sdpipe creates it (default: the GPUs torch sees on
  this node, at least 1). The limit `sdpipe-gpu-<pool>` is created on first use; after that
  the server's value rules (change it with `prefect gcl update sdpipe-gpu-<pool> --limit N`).

A score or encode shard task holds 1 slot while it works; a training holds as many slots as
it uses GPUs on its node (capped at the limit), so it waits for the shards on its GPUs to end.

A slot is a number, not a GPU: `gpu_devices` also claims which GPU, with an exclusive file lock
per device in a per-node folder (`SDPIPE_DEVICE_LOCKS`, default `<tmp>/sdpipe-devices/<pool>`),
so holders in different processes never share one. The OS drops a killed holder's locks.
`SDPIPE_DEVICES` lists the devices instead of the GPUs torch sees (`cpu,cpu`: two CPU twins
`cpu:0`, `cpu:1`, which tests use to stand for two GPUs).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.runtime.node import gpu_pool, local_gpus, node_devices

if TYPE_CHECKING:
    import torch

LIMIT_PREFIX = "sdpipe-gpu-"
CLAIM_POLL_S = 0.2  # flock cannot wait for "any one of N files": a waiting claim retries

log = logging.getLogger(__name__)


def gpu_limit_name(pool: str | None = None) -> str:
    """`sdpipe-gpu-<pool>`, lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9-]+", "-", (pool or gpu_pool()).lower()).strip("-")
    return LIMIT_PREFIX + (slug or "default")


def gpu_slots() -> int:
    if value := os.environ.get("SDPIPE_GPU_SLOTS"):
        return max(1, int(value))
    return len(node_devices()) if os.environ.get("SDPIPE_DEVICES") else max(1, local_gpus())


def ensure_gpu_limit(name: str | None = None) -> int:
    """Create the pool's limit with `gpu_slots()` slots unless it exists; returns its limit."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = name or gpu_limit_name()
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run created it first
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=gpu_slots())
                )
            return client.read_global_concurrency_limit_by_name(name).limit


@contextlib.contextmanager
def gpu_slot(occupy: int = 1) -> Iterator[int]:
    """Hold `occupy` slots (capped at the limit) of this pool's limit; yields the slots held."""
    from prefect.concurrency.sync import concurrency

    name = gpu_limit_name()
    occupy = max(1, min(occupy, ensure_gpu_limit(name)))
    with concurrency(name, occupy=occupy, strict=True):
        yield occupy


# ---- which device a slot holder uses ---------------------------------------------------------


def _lock_name(device: str) -> str:
    """The lock file of a device. A CUDA index is translated through CUDA_VISIBLE_DEVICES, so
    processes that see different subsets of the node's GPUs still lock the same physical one."""
    kind, index = device.split(":")
    if kind == "cuda" and (visible := os.environ.get("CUDA_VISIBLE_DEVICES")):
        index = visible.split(",")[int(index)].strip()
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{kind}-{index}") + ".lock"


def device_lock_dir(pool: str | None = None) -> Path:
    """The node's folder of device locks, one per pool (pretend nodes on one machine each
    have their own pool, hence their own devices)."""
    base = os.environ.get("SDPIPE_DEVICE_LOCKS") or Path(tempfile.gettempdir()) / "sdpipe-devices"
    return Path(base) / gpu_limit_name(pool)


@contextlib.contextmanager
def claim_devices(count: int = 1) -> Iterator[list[torch.device]]:
    """Claim `count` distinct devices of this node (at most as many as it has), each with an
    exclusive lock held until the block ends; waits until that many are free at once (never
    holding some while waiting for more: two claims cannot deadlock)."""
    import torch

    devices = node_devices()
    count = max(1, min(count, len(devices)))
    folder = device_lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    held: dict[str, int] = {}
    warned = False
    try:
        while True:
            for device in devices:
                if len(held) == count:
                    break
                if (fd := _try_lock(folder / _lock_name(device))) is not None:
                    held[device] = fd
            if len(held) == count:
                break
            if not warned:
                log.warning("devices of %s taken; waiting for %d to be free", folder, count)
                warned = True
            for fd in held.values():
                os.close(fd)
            held.clear()
            time.sleep(CLAIM_POLL_S)
        yield [torch.device(d) for d in held]
    finally:
        for fd in held.values():
            os.close(fd)  # closing the last descriptor releases the flock


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock of `path`, or None if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)  # who holds it, for a person looking at the folder
    os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
    return fd


@contextlib.contextmanager
def gpu_devices(count: int = 1) -> Iterator[list[torch.device]]:
    """Hold `count` slots of this node's pool (capped at the limit and the node's devices) and
    claim as many distinct devices (`cuda:3`; `cpu:0` on a node without GPUs)."""
    count = max(1, min(count, len(node_devices())))
    with gpu_slot(count) as held, claim_devices(held) as devices:
        yield devices


@contextlib.contextmanager
def gpu_device() -> Iterator[torch.device]:
    """One slot of this node's pool and the device it names (`cuda:3`; `cpu:0` without GPUs)."""
    with gpu_devices(1) as (device,):
        yield device
