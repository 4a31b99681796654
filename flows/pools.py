"""GPU pools: one Prefect global concurrency limit per pool of GPUs, held by score, encode and
train work so they never oversubscribe the GPUs, however many flow runs the workers start.

Settings (environment of the worker, hence of every flow run it starts):
- `SDPIPE_GPU_POOL`: the pool's name (default: this host's name, i.e. one pool per node).
- `SDPIPE_GPU_SLOTS`: the limit's slots when sdpipe creates it (default: the GPUs torch sees on
  this node, at least 1). The limit `sdpipe-gpu-<pool>` is created on first use; after that
  the server's value rules (change it with `prefect gcl update sdpipe-gpu-<pool> --limit N`).

A score or encode shard task holds 1 slot while it works; a training holds as many slots as
it uses GPUs on its node (capped at the limit), so it waits for the shards on its GPUs to end.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator

LIMIT_PREFIX = "sdpipe-gpu-"


def gpu_pool() -> str:
    return os.environ.get("SDPIPE_GPU_POOL") or socket.gethostname()


def gpu_limit_name(pool: str | None = None) -> str:
    """`sdpipe-gpu-<pool>`, lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9-]+", "-", (pool or gpu_pool()).lower()).strip("-")
    return LIMIT_PREFIX + (slug or "default")


def local_gpus() -> int:
    """CUDA devices visible to this process (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_slots() -> int:
    if value := os.environ.get("SDPIPE_GPU_SLOTS"):
        return max(1, int(value))
    return max(1, local_gpus())


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
