"""Lanes: worker processes fed over pipes, one feeding thread per worker, from one queue of
futures. The base of every process pool of a node: image decode (tasks/latents/images.py),
fetch-images' downloaders (tasks/sources/fetch_images.py), calls in processes (calls.py).

A pool given the node's `Slots` (tasks/runtime/node.py) starts a worker only under a slot it
holds and gives the slot back once the worker has exited: a lane with no worker asks for a
slot only while requests wait, and gives its slot back when another kind of pool waits with
less than its share (`Slots.should_yield`).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.runtime.node import Slots

POLL_S = 0.1  # a lane holding a slot and no request looks at the node's other pools this often


class Lanes:
    """Worker processes fed over pipes, one feeding thread per worker, from one queue of
    futures; the base of the decode pool and of fetch-images' downloaders. A subclass says
    how to start a worker (`_start`, an object with `call` and `close`) and how to run a
    request on it (`_run`, which may replace a worker that died)."""

    def __init__(
        self, num_workers: int, name: str, *, eager: bool = False, slots: Slots | None = None
    ):
        """`eager`: start every worker process now, not at its first request. `slots`: the
        node's process slots, under which its workers live (None: as many as `num_workers`)."""
        self.eager, self.slots, self.kind = eager, slots, name
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # requests queued, not taken by a lane yet
        self.closing = False
        self.cond = threading.Condition()
        self.threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for t in self.threads:
            t.start()

    def _submit(self, request) -> Future:
        future: Future = Future()
        with self.cond:
            self.pending += 1
            self.tasks.put((future, request))
            self.cond.notify()
        return future

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        for _ in self.threads:
            self.tasks.put(None)
        for t in self.threads:
            t.join()
        # What no lane took (its lanes gave up waiting for a slot): cancelled, not left hanging.
        while True:
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                return
            if task is not None:
                task[0].cancel()

    def _start(self):
        raise NotImplementedError

    def _run(self, worker, request) -> tuple:
        """(the request's result, or the exception that fails it; the worker to keep: None
        if it died)."""
        raise NotImplementedError

    def _serve(self) -> None:
        if self.slots is None:
            self._serve_alone()
        else:
            self._serve_in_slots(self.slots)

    def _first_worker(self):
        if not self.eager:
            return None
        try:
            return self._start()
        except OSError:  # started again at the first request, which then reports the error
            return None

    def _serve_alone(self) -> None:
        worker = self._first_worker()
        while (task := self.tasks.get()) is not None:
            with self.cond:
                self.pending -= 1
            worker = self._one(worker, task)
        if worker is not None:
            worker.close()

    def _serve_in_slots(self, slots: Slots) -> None:
        worker, holding, first = None, False, self.eager
        idle_since: float | None = None
        try:
            while True:
                if not holding:
                    with self.cond:  # a slot is asked for only while requests wait
                        while not (self.pending or first or self.closing):
                            self.cond.wait()
                        if self.closing and not self.pending:
                            return
                    if not slots.acquire(self.kind, give_up=lambda: self.closing):
                        return
                    holding, idle_since = True, time.monotonic()
                    if first:
                        worker, first = self._first_worker(), False
                try:
                    task = self.tasks.get(timeout=POLL_S)
                except queue.Empty:
                    idle_s = time.monotonic() - idle_since
                    if self.closing or slots.should_yield(self.kind, idle_s=idle_s):
                        worker, holding = self._give_back(worker, slots)
                    continue
                if task is None:
                    return
                with self.cond:
                    self.pending -= 1
                worker = self._one(worker, task)
                idle_since = time.monotonic()
                if slots.should_yield(self.kind, idle_s=None):
                    worker, holding = self._give_back(worker, slots)
        finally:
            if worker is not None:
                worker.close()
            if holding:
                slots.release(self.kind)

    def _give_back(self, worker, slots: Slots) -> tuple[None, bool]:
        """The worker exits, then its slot goes back: a slot never stands for two processes."""
        if worker is not None:
            worker.close()
        slots.release(self.kind)
        return None, False

    def _one(self, worker, task):
        future, request = task
        if not future.set_running_or_notify_cancel():
            return worker
        try:
            result, worker = self._run(worker, request)
        except BaseException as e:  # e.g. no process could be started: fail the request
            future.set_exception(e)
            return worker
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
        return worker
