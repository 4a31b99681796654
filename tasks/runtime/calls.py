"""Calls in worker processes: a node's pool of plain `python -m tasks.runtime.calls` processes
(no fork: the caller may hold threads and a GPU), each running pickled `fn(*args, **kwargs)`
requests one at a time for stages whose Python holds the GIL (tokenize).

A worker that dies in a call fails that call (`WorkerDied`) and is replaced for the next; a
call's own exception is raised in the caller. Workers exit when their stdin closes, so a killed
parent leaves no orphans.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tasks.runtime.lanes import Lanes
from tasks.runtime.net import python_path

COMMAND = (sys.executable, "-m", "tasks.runtime.calls")


class WorkerDied(RuntimeError):
    """The worker process running a call exited."""


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen(
            COMMAND,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": python_path()},
        )

    def call(self, request: tuple) -> tuple[bool, Any]:
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
            self.proc.stdin.flush()
            return pickle.load(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            self.proc.kill()
            self.proc.wait()
            raise WorkerDied(f"call worker exited with {self.proc.returncode}") from e

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


class CallPool(Lanes):
    """`num_workers` call workers (under the node's `slots` when given)."""

    def __init__(self, num_workers: int, slots=None):
        super().__init__(num_workers, "call", slots=slots)

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        return self._submit((fn, args, kwargs))

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        return self.submit(fn, *args, **kwargs).result()

    def _start(self) -> _Worker:
        return _Worker()

    def _run(self, worker, request) -> tuple:
        worker = worker or self._start()
        try:
            ok, value = worker.call(request)
        except WorkerDied as e:
            return e, None
        return (value if ok else _error(value)), worker


def _error(value) -> BaseException:
    return value if isinstance(value, BaseException) else RuntimeError(str(value))


def serve() -> None:
    """A worker's loop: length-prefixed pickled (fn, args, kwargs) on stdin, pickled (True,
    result) or (False, the exception, or its traceback if it cannot be pickled) on stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the call prints goes to stderr, not into the protocol
    requests = sys.stdin.buffer
    while header := requests.read(8):
        fn, args, kwargs = pickle.loads(requests.read(int.from_bytes(header, "little")))
        try:
            reply = (True, fn(*args, **kwargs))
        except Exception as e:
            reply = (False, e)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = pickle.dumps((False, traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
        out.write(data)
        out.flush()


if __name__ == "__main__":
    serve()
