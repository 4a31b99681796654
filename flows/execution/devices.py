"""The GPU stages of a flow run on every device of the node: one long-lived worker per device.

A GPU stage of build-latents (score, encode) keeps its one task run per shard (named, cached,
retried, its own record, "rerun the failed ones"), but the work runs in a `Devices`: one lane
per device of the node (`pools.node_devices`). A shard's task run deals its shard to a lane
and waits for it. Each lane's worker claims a device of the GPU pool (a slot of the pool's
Prefect limit and the device's lock: `pools.gpu_devices`, so two flow runs never put two
workers on one GPU), builds its model there once and runs one pipeline over the shards it is
dealt (encode reads the next shard while it encodes one: `encode.encode_stream`). Eight GPUs
run eight encoders; a node without GPUs has one lane on `cpu:0`, one shard at a time, as
before.

Dealing: a shard goes to the lane with the fewest shards outstanding, ties in turn, so shards
spread over the devices whatever the order they come in. A lane still waiting for a device
after `STEAL_AFTER_S` (another flow run or a training holds them) gives its shards to lanes
that have one. A worker gives its device back, and frees its model there, when no shard came
for `IDLE_S` or when the stage closes; the next shard dealt to the lane starts a new one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from flows.execution import pools

if TYPE_CHECKING:
    import torch

IDLE_S = 30.0  # a worker with nothing to do gives its device back after this long
STEAL_AFTER_S = 5.0  # a lane waiting this long for a device gives its shards away
POLL_S = 0.5

# serve(device, shards) -> (shard, its result or the exception that failed it), per shard
# taken from `shards` (an iterator that waits for the next one, ends when the lane is done).
Serve = Callable[["torch.device", Iterator[str]], Iterator[tuple[str, Any]]]
Claim = Callable[[], contextlib.AbstractContextManager]


class _Lane:
    def __init__(self, index: int):
        self.index = index
        self.queue: deque[str] = deque()  # dealt, not taken yet
        self.taken: set[str] = set()  # taken by the worker, not finished yet
        self.worker: threading.Thread | None = None
        self.device: torch.device | None = None
        self.claiming_since: float | None = None
        self.idle_since = time.monotonic()
        self.leaving = False  # its worker takes no more shards

    def outstanding(self) -> int:
        return len(self.queue) + len(self.taken)


class Devices:
    """One GPU stage of one flow run on the node's devices; see the module's docstring.

    `run(shard)` (from the shard's task run) returns `serve`'s result for it or raises its
    error. `claim()` -> a context manager yielding [device] (default: one device of the GPU
    pool); `release(device)` frees what `serve` built there once the worker gives it back.
    """

    def __init__(
        self,
        name: str,
        serve: Serve,
        *,
        lanes: int | None = None,
        claim: Claim | None = None,
        release: Callable[[torch.device], None] | None = None,
        idle_s: float | None = None,
        steal_after_s: float | None = None,
    ):
        self.name, self.serve, self.release = name, serve, release
        self.claim = claim or (lambda: pools.gpu_devices(1))
        # The module's settings as they are now (not when this module was imported).
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self.steal_after_s = STEAL_AFTER_S if steal_after_s is None else steal_after_s
        self.lanes = [_Lane(i) for i in range(lanes or len(pools.node_devices()))]
        self.cond = threading.Condition()
        self.futures: dict[str, Future] = {}
        self.turn = 0
        self.closed = False

    def __len__(self) -> int:
        return len(self.lanes)

    def __enter__(self) -> Devices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, shard: str) -> Any:
        return self.submit(shard).result()

    def submit(self, shard: str) -> Future:
        future: Future = Future()
        with self.cond:
            if self.closed:
                raise RuntimeError(f"{self.name}: closed, cannot take {shard}")
            self.futures[shard] = future  # a retried shard's new attempt replaces the old one
            lane = self._deal()
            lane.queue.append(shard)
            if lane.worker is None:
                self._start(lane)
            self.cond.notify_all()
        return future

    def close(self) -> None:
        """No more shards: workers give their devices back once their shards are done."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            working = [lane.worker for lane in self.lanes if lane.worker and lane.device]
        # A worker still waiting for a device is not waited for: it gives it back at once.
        for worker in working:
            worker.join()

    def devices_in_use(self) -> list[str]:
        with self.cond:
            return [str(lane.device) for lane in self.lanes if lane.device is not None]

    # ---- inside --------------------------------------------------------------------------

    def _stuck(self, lane: _Lane, now: float) -> bool:
        return lane.claiming_since is not None and now - lane.claiming_since >= self.steal_after_s

    def _deal(self) -> _Lane:
        now, n = time.monotonic(), len(self.lanes)
        lane = min(
            self.lanes,
            key=lambda x: (self._stuck(x, now), x.outstanding(), (x.index - self.turn) % n),
        )
        self.turn = lane.index + 1
        return lane

    def _start(self, lane: _Lane) -> None:
        lane.leaving, lane.idle_since = False, time.monotonic()
        lane.claiming_since = time.monotonic()
        lane.worker = threading.Thread(
            target=self._work, args=(lane,), name=f"{self.name}-lane-{lane.index}", daemon=True
        )
        lane.worker.start()

    def _work(self, lane: _Lane) -> None:
        error: BaseException | None = None
        finished = 0
        try:
            with self.claim() as (device,):
                if device.type == "cuda":
                    import torch

                    torch.cuda.set_device(device)  # per thread: this worker's default GPU
                with self.cond:
                    lane.device, lane.claiming_since = device, None
                try:
                    for shard, outcome in self.serve(device, self._take(lane)):
                        self._finish(lane, shard, outcome)
                        finished += 1
                finally:
                    with self.cond:
                        lane.device = None
                    if self.release is not None:
                        self.release(device)
        except BaseException as e:  # the pipeline broke, or no device could be claimed
            error = e
        finally:
            self._end(lane, error, finished)

    def _take(self, lane: _Lane) -> Iterator[str]:
        """The lane's shards, one at a time, waiting for the next; ends when the lane has had
        nothing to do for `idle_s`, or the stage is closed and the lane's shards taken."""
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    if lane.queue:
                        shard = lane.queue.popleft()
                        break
                    if (shard := self._steal(now)) is not None:
                        break
                    idle = not lane.taken and now - lane.idle_since >= self.idle_s
                    if self.closed or idle:
                        lane.leaving = True
                        return
                    self.cond.wait(POLL_S)
                lane.taken.add(shard)
            yield shard

    def _steal(self, now: float) -> str | None:
        for other in self.lanes:
            if other.queue and self._stuck(other, now):
                return other.queue.pop()
        return None

    def _finish(self, lane: _Lane, shard: str, outcome: Any) -> None:
        with self.cond:
            lane.taken.discard(shard)
            if not lane.taken:
                lane.idle_since = time.monotonic()
            future = self.futures.pop(shard, None)
            self.cond.notify_all()
        if future is None:
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _end(self, lane: _Lane, error: BaseException | None, finished: int) -> None:
        """The worker is gone: the shards it took and never finished fail with its error, and
        so does every shard dealt to it if it failed before finishing one (no device, no
        model: a new worker would fail the same way); else a new worker takes the rest."""
        with self.cond:
            failed = list(lane.taken)
            lane.taken.clear()
            if error is not None and not finished:
                failed += list(lane.queue)
                lane.queue.clear()
            lane.worker, lane.device, lane.claiming_since = None, None, None
            futures = [(s, self.futures.pop(s, None)) for s in failed]
            if lane.queue:
                self._start(lane)
            self.cond.notify_all()
        for shard, future in futures:
            if future is not None:
                future.set_exception(
                    error or RuntimeError(f"{self.name}: the worker ended before {shard}")
                )


def read_ahead(shards: Iterator[str], warm: Callable[[str], None]) -> Iterator[str]:
    """`shards`, the next one's inputs warmed (`warm(shard)`: read into the page cache) by a
    thread while the one before is worked on: a worker whose own pipeline reads a whole shard
    at once (score) still finds its next shard's bytes in memory."""
    import queue

    ready: queue.Queue = queue.Queue()
    handed = threading.Semaphore(1)  # the next shard is taken once the one before is handed
    stop = threading.Event()
    end = object()

    def fetch() -> None:
        try:
            while True:
                while not handed.acquire(timeout=POLL_S):
                    if stop.is_set():
                        return
                if stop.is_set() or (shard := next(shards, end)) is end:
                    return
                with contextlib.suppress(OSError):  # a missing input fails its shard, later
                    warm(shard)
                ready.put(shard)
        except BaseException as e:  # the shards' source failed: the worker raises it
            ready.put(e)
        finally:
            ready.put(end)

    thread = threading.Thread(target=fetch, name="read-ahead", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            handed.release()
            yield item
    finally:
        # Stopped early: the reader ends before the worker does, so a shard it took and did
        # not hand over is failed with the worker's (Devices._end), not left waiting.
        stop.set()
        thread.join()


def warm_file(path) -> None:
    """Read a file through, so the next read of it comes from the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
