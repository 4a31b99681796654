"""A throwaway server process on 127.0.0.1 (Redis, PostgreSQL) for tests, benchmarks and the
loopback walk-through: a free port and a fresh temporary folder; `with` starts it, or fails
saying why it cannot run here, and on exit stops it and removes the folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Self

from tasks.runtime.net import free_port


class LoopbackServer:
    """A subclass names its folder's prefix and says how the server starts and stops."""

    folder_prefix = "sdpipe-server-"

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=self.folder_prefix))

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this server cannot run here, or None if it can."""
        return None

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        """Stop the server if it runs (the folder is removed after)."""
        raise NotImplementedError

    def start(self) -> Self:
        if reason := self.unavailable_reason():
            raise RuntimeError(reason)
        self._start()
        return self

    def stop(self) -> None:
        self._stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
