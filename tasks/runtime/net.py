"""Loopback helpers shared by the demo server, torchrun launches and tests, and what a Ray
cluster's nodes need to reach it and run this checkout (`python_path`, `node_env`)."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

# This checkout (the folder of flows/, tasks/, sdtrain/, catalog/).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(
    handler, host: str = "127.0.0.1", port: int = 0, request_queue_size: int = 5
) -> Iterator[str]:
    """`handler` served on `host:port` (0: a free port), a thread per request, while the block
    runs: its base URL. Shut down and closed at the end (the demo's mirror, the tests' and
    benchmarks' upstreams)."""

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

    Server.request_queue_size = request_queue_size
    server = Server((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


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
    """This checkout first on a child's PYTHONPATH (decode and download workers, a Ray node's
    actors): it runs this code, not a copy installed there (the same path on every node)."""
    paths = [str(PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(paths))


# What every node's actors take from the process that starts them: sdpipe's settings, the
# Hugging Face and W&B ones, the Prefect API's (the flows add the API of a Prefect profile).
FORWARDED_PREFIXES = ("SDPIPE_", "HF_", "WANDB_", "PREFECT_API_")
FORWARDED_NAMES = ("NO_ALBUMENTATIONS_UPDATE",)
# Not forwarded: a node's own budget, name, GPU pool and devices (set per node where needed).
NODE_OWN = (
    "SDPIPE_WORKERS",
    "SDPIPE_NODE",
    "SDPIPE_GPU_POOL",
    "SDPIPE_DEVICES",
    "SDPIPE_GPU_SLOTS",
)
# Paths, made absolute: an actor's working folder is not this process's (shared storage is
# mounted at the same path on every node).
PATH_SETTINGS = (
    "SDPIPE_DATA",
    "SDPIPE_CATALOG",
    "SDPIPE_WEIGHTS",
    "SDPIPE_SEMANTIC_TEMP",
    "SDPIPE_DUCKDB_TEMP",
    "SDPIPE_DEVICE_LOCKS",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "WANDB_DIR",
)


def node_env() -> dict[str, str]:
    """This process's settings for the actors it starts on a cluster's nodes (build agents,
    training launchers, encode and generation workers): the forwarded prefixes and names less
    each node's own, paths absolute, the weights folder as this process resolves it (its
    default is relative: ./weights here, not in an actor's folder), and this checkout first
    on PYTHONPATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and k not in NODE_OWN
    }
    for k in PATH_SETTINGS:
        if env.get(k):
            env[k] = str(Path(env[k]).absolute())
    env["SDPIPE_WEIGHTS"] = env.get("SDPIPE_WEIGHTS") or str(Path("weights").absolute())
    env["PYTHONPATH"] = python_path()
    return env
