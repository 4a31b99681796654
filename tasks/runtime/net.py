"""Loopback helpers shared by the demo server, torchrun launches and tests, and what a Ray
cluster's nodes need to reach it and run this checkout."""

from __future__ import annotations

import os
import socket
from pathlib import Path

# This checkout (the folder of flows/, tasks/, sdtrain/, catalog/).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at a Ray cluster's `HOST:PORT` (or `ray://HOST:PORT`) address, or
    None if it accepts a connection (or is not of that form: `auto`, `local`). `ray.init` on an
    address where nothing listens retries for minutes before it fails; this fails in seconds."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{host}:{port}: {e.strerror or e}"


def python_path() -> str:
    """This checkout first on a Ray node's PYTHONPATH: its actors run this code, not a copy
    installed there (the same path on every node)."""
    paths = [str(PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(paths))
