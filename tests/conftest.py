"""Shared fixtures: a small demo catalog, and one Prefect server + worker for the session.

Most tests call stage functions directly; only tests that need orchestration (deployments,
flow-run retries) use `prefect_stack`, which starts a real server on a free loopback port
with its SQLite database, a process worker and every deployment of prefect.yaml.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The GPU pool's device locks (flows/execution/pools.py) live in /tmp/sdpipe-devices by default: one
# folder per test process, so parallel test workers (and other checkouts' suites on this
# machine) never wait on each other's "devices".
if "SDPIPE_DEVICE_LOCKS" not in os.environ:  # made here (xdist workers inherit it): gone at exit
    os.environ["SDPIPE_DEVICE_LOCKS"] = tempfile.mkdtemp(prefix="sdpipe-test-locks-")
    atexit.register(shutil.rmtree, os.environ["SDPIPE_DEVICE_LOCKS"], ignore_errors=True)

DEMO_IMAGES = 60


def write_small_catalog(dest: Path, *, num_images: int = DEMO_IMAGES) -> Path:
    """The shipped catalog with a smaller demo source (and shards), for fast tests."""
    from catalog.copies import copy_catalog, edit_entries

    copy_catalog(dest)
    with edit_entries(dest / "sources.yaml") as sources:
        sources["demo"]["options"] = {"num_images": num_images, "seed": 1}
        sources["demo"]["samples_per_shard"] = 24
    with edit_entries(dest / "phases.yaml") as phases:
        phases["demo"]["max_steps"] = 4
        phases["demo"]["allow_short"] = True  # asks for the 240 of the full-size demo source
    return dest


@pytest.fixture(scope="session")
def small_catalog(tmp_path_factory) -> Path:
    return write_small_catalog(tmp_path_factory.mktemp("catalog") / "catalog")


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory, small_catalog):
    """(data root, port) of a running Prefect server + worker with all deployments."""
    from flows.cli import local
    from tasks.runtime.net import free_port

    root = tmp_path_factory.mktemp("prefect-data")
    port = free_port()
    saved = {k: os.environ.get(k) for k in ("SDPIPE_CATALOG", "PREFECT_API_URL", "PREFECT_HOME")}
    os.environ["SDPIPE_CATALOG"] = str(small_catalog)
    os.environ["PREFECT_HOME"] = str(local.prefect_dir(root))
    os.environ["PREFECT_API_URL"] = local.api_url(port)
    try:
        local.ensure_server(root, port)
        local.deploy(root, port)
        local.ensure_worker(root, port)
        yield root, port
    finally:
        local.stop(root)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def one_torch_thread_per_module():
    """A test module's tests on one torch thread (tests/torch_threads.py)."""
    from tests.torch_threads import one_torch_thread

    with one_torch_thread():
        yield


# Worker nodes of the shared local Ray cluster (tests/ray_cluster.py).
CLUSTER_NODES = 3


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster of `CLUSTER_NODES` worker nodes (2 CPUs each) and a CPU-less head,
    shared by the test process's cluster tests; each test gets it back with every node."""
    from tests.ray_cluster import local_cluster

    with local_cluster(CLUSTER_NODES) as cluster:
        yield cluster


@pytest.fixture
def cluster(ray_cluster):
    """The shared cluster, its nodes restored after the test (one it killed is replaced)."""
    yield ray_cluster
    ray_cluster.ensure(CLUSTER_NODES)
