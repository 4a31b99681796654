"""Lanes: worker processes fed over pipes, one feeding thread per worker, from one queue of
futures. The base of the image decode pool (tasks/latents/images.py) and of fetch-images'
downloaders (tasks/sources/fetch_images.py)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class Lanes:
    """Worker processes fed over pipes, one feeding thread per worker, from one queue of
    futures; the base of the decode pool and of fetch-images' downloaders. A subclass says
    how to start a worker (`_start`, an object with `call` and `close`) and how to run a
    request on it (`_run`, which may replace a worker that died)."""

    def __init__(self, num_workers: int, name: str, *, eager: bool = False):
        """`eager`: start every worker process now, not at its first request."""
        self.eager = eager
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for t in self.threads:
            t.start()

    def _submit(self, request) -> Future:
        future: Future = Future()
        self.tasks.put((future, request))
        return future

    def close(self) -> None:
        for _ in self.threads:
            self.tasks.put(None)
        for t in self.threads:
            t.join()

    def _start(self):
        raise NotImplementedError

    def _run(self, worker, request) -> tuple:
        """(the request's result, or the exception that fails it; the worker to keep: None
        if it died)."""
        raise NotImplementedError

    def _serve(self) -> None:
        worker = None
        if self.eager:
            try:
                worker = self._start()
            except OSError:  # started again at the first request, which then reports the error
                worker = None
        while (task := self.tasks.get()) is not None:
            future, request = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result, worker = self._run(worker, request)
            except BaseException as e:  # e.g. no process could be started: fail the request
                future.set_exception(e)
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if worker is not None:
            worker.close()
