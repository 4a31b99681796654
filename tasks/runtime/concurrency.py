"""How much of the node a stage uses: one setting, with per-stage defaults derived from it.

- `SDPIPE_WORKERS` (also build-latents' `workers` parameter): the node's worker budget, by
  default the cores this process may run on, read once where a process builds its node
  (tasks/runtime/node.py). CPU stages (repack, tokenize, decode pools) size their process
  pools from it, and every live worker process of them holds one of the node's slots.
- `SDPIPE_FETCH_SHARDS`: fetch-images shard tasks at once (I/O bound; they share the node's
  img2dataset downloader processes, see `fetch_parallelism`).
- `SDPIPE_FETCH_PROCESSES`, `SDPIPE_FETCH_THREADS`: those downloader processes (default one
  per worker of the budget, as img2dataset's README runs one process per core) and the
  download threads of each (default 64, the low end of the README's 64-128): by default
  64 x the cores requests in flight on the node.
- GPU stages (score, encode, semantic dedup) run one worker per device of the GPU pool
  (`flows/execution/pools.py`, `flows/execution/devices.py`), not a number from here.
- Stages whose Python holds the GIL (tokenize) run their shards in the node's call processes
  (`Node.in_process`), where the budget is over `THREADS_UP_TO`; up to it, in the flow's threads (a
  spawned interpreter costs ~3 s of imports, more than two threads lose to the GIL).
- `SDPIPE_TOKENIZE_PROCESSES`: tokenize's processes, by default the budget up to
  TOKENIZE_PROCESSES_MAX (16): each is a ~0.5 GB interpreter alive for the whole run, and 16
  keep encode fed (a CLIP tokenizer does ~10k captions/s per process); 128 on a 128-core node
  would hold ~64 GB for nothing.

Defaults keep a 2-core machine (CI) at 2 shards at a time, as before.
"""

from __future__ import annotations

import os

THREADS_UP_TO = 2


def cores() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return n


def workers(override: int | None = None) -> int:
    """The node's worker budget: `override` (a flow parameter), else `SDPIPE_WORKERS`, else
    the cores."""
    if override is not None:
        if override < 1:
            raise ValueError(f"workers={override}: expected a positive integer")
        return override
    return _env_int("SDPIPE_WORKERS") or cores()


def fetch_shards(budget: int | None = None) -> int:
    """fetch-images shard tasks at once: `SDPIPE_FETCH_SHARDS`, else one per 8 workers of the
    budget (each shard's img2dataset uses several processes itself), at least 2."""
    return _env_int("SDPIPE_FETCH_SHARDS") or max(2, workers(budget) // 8)


FETCH_THREADS = 64


def fetch_parallelism(budget: int | None = None) -> tuple[int, int]:
    """(img2dataset downloader processes of the node, download threads per process):
    `SDPIPE_FETCH_PROCESSES`, else one per worker of the budget; `SDPIPE_FETCH_THREADS`, else
    FETCH_THREADS. The fetch shard tasks running at once share these processes."""
    processes = _env_int("SDPIPE_FETCH_PROCESSES") or workers(budget)
    return processes, _env_int("SDPIPE_FETCH_THREADS") or FETCH_THREADS


def pooled_shards(budget: int | None = None) -> int:
    """Shard tasks at once of a stage whose heavy work runs in a process pool shared by its
    shards (repack: the decode workers, `workers` of them): each shard task only reads and
    feeds, so one per 8 workers keeps the pool busy; at least 2."""
    return max(2, workers(budget) // 8)


def use_processes(budget: int | None = None) -> bool:
    """Whether GIL-bound shard work goes to processes (the budget is over THREADS_UP_TO)."""
    return workers(budget) > THREADS_UP_TO


TOKENIZE_PROCESSES_MAX = 16


def tokenize_processes(budget: int | None = None) -> int:
    """tokenize's worker processes: `SDPIPE_TOKENIZE_PROCESSES`, else the budget, at most
    TOKENIZE_PROCESSES_MAX."""
    return _env_int("SDPIPE_TOKENIZE_PROCESSES") or min(workers(budget), TOKENIZE_PROCESSES_MAX)
