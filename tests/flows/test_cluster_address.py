"""A cluster address where nothing answers fails in seconds, naming it (`ray.init` alone retries
for minutes), for a build on the cluster and for a training on N nodes; so do an address other
than the cluster this process is already connected to (naming both), and a cluster with token
authentication on that this process sends no token (naming the token and what to set)."""

from __future__ import annotations

import logging
import re
import time

import pytest

from flows.execution.cluster import Cluster, ClusterError
from tasks.phases.train import TrainingFailed
from tasks.phases.train_nodes import connected
from tasks.runtime.net import free_port, unreachable


def test_nothing_listening_is_unreachable_and_a_listener_is_not():
    address = f"127.0.0.1:{free_port()}"
    assert "127.0.0.1" in unreachable(address)
    assert unreachable(f"ray://{address}") is not None
    assert unreachable("auto") is None and unreachable("local") is None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert unreachable(f"127.0.0.1:{s.getsockname()[1]}") is None


def test_a_build_on_an_unreachable_cluster_fails_at_once_naming_it():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ClusterError, match=f"no Ray cluster answers at '{address}'"):
        Cluster(address)
    assert time.monotonic() - started < 30


def test_a_training_on_an_unreachable_cluster_fails_at_once_naming_it():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with (
        pytest.raises(TrainingFailed, match=f"no Ray cluster answers at '{address}'"),
        connected(address, 2),
    ):
        pass
    assert time.monotonic() - started < 30


@pytest.mark.cluster
def test_another_address_than_the_open_connections_is_refused_naming_both(cluster):
    import ray

    other = f"127.0.0.1:{free_port()}"
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        current = ray.get_runtime_context().gcs_address
        both = re.escape(f"connected to the Ray cluster at '{current}', not to the one asked for")
        with pytest.raises(ClusterError, match=f"{both} at '{other}'"):
            Cluster(other)
        with pytest.raises(TrainingFailed, match=f"{both} at '{other}'"), connected(other, 2):
            pass
        from tasks.runtime.ray_connect import connect

        # The open cluster is used and left open.
        assert connect(cluster.address) is False
        assert ray.is_initialized()
    finally:
        ray.shutdown()


@pytest.mark.cluster
def test_a_cluster_with_token_auth_refuses_a_process_without_its_token_saying_what_to_set(
    cluster,
):
    from tests.ray_cluster import set_auth

    saved = set_auth({"RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN": None, "RAY_AUTH_TOKEN_PATH": None})
    started = time.monotonic()
    try:
        none = "token authentication on and this process sends no token: set RAY_AUTH_MODE=token"
        with pytest.raises(ClusterError, match=none):
            Cluster(cluster.address)
        with pytest.raises(TrainingFailed, match=none), connected(cluster.address, 2):
            pass
        set_auth({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-clusters"})
        with pytest.raises(ClusterError, match="refuses this process's token"):
            Cluster(cluster.address)
    finally:
        set_auth(saved)
    assert time.monotonic() - started < 10  # not ray.init's ~20 s of retries
