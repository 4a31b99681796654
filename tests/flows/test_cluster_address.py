"""A cluster address where nothing answers fails in seconds, naming it (`ray.init` alone retries
for minutes), for a build on the cluster and for a training on N nodes."""

from __future__ import annotations

import time

import pytest

from flows.cluster import Cluster, ClusterError
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
