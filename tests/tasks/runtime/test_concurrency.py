"""The node's worker budget and what each build-latents stage runs at once from it."""

from __future__ import annotations

import os

import pytest

from flows.build_latents import stage_limits
from tasks.runtime import concurrency
from tasks.runtime.calls import CallPool
from tasks.runtime.node import Node, local_node


def test_the_budget_is_the_parameter_else_the_setting_else_the_cores(monkeypatch):
    monkeypatch.delenv("SDPIPE_WORKERS", raising=False)
    assert concurrency.workers() == concurrency.cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("SDPIPE_WORKERS", "48")
    assert concurrency.workers() == 48
    assert concurrency.workers(6) == 6  # the flow parameter wins
    for bad in ("0", "many"):
        monkeypatch.setenv("SDPIPE_WORKERS", bad)
        with pytest.raises(ValueError, match="SDPIPE_WORKERS"):
            concurrency.workers()
    with pytest.raises(ValueError, match="workers=0"):
        concurrency.workers(0)


def test_each_stage_derives_its_concurrency_from_the_budget(monkeypatch):
    monkeypatch.delenv("SDPIPE_FETCH_SHARDS", raising=False)
    # The 2-core CI machine, no GPU: 2 at a time as before; score and encode on cpu:0.
    assert stage_limits(2, 1) == {
        "metadata": 2,
        "shards": 2,
        "scores": 4,
        "views": 2,
        "tokens": 2,
        "latents": 4,
    }
    assert not concurrency.use_processes(2)  # tokenize in the flow's threads
    # One 8-GPU, 64-core node.
    node = stage_limits(64, 8)
    assert (node["shards"], node["tokens"], node["scores"], node["latents"]) == (8, 64, 32, 32)
    assert concurrency.use_processes(64)  # tokenize holds the GIL: processes
    assert stage_limits(64, 8, archive=True)["shards"] == 8  # repack readers
    monkeypatch.setenv("SDPIPE_FETCH_SHARDS", "20")
    assert stage_limits(64, 8)["shards"] == 20


def test_work_in_the_process_pool_runs_in_another_process():
    node = local_node(2)
    assert node.in_process(2, os.getpid) != os.getpid()
    pool = node.pool("call", 2, CallPool)
    assert node.pool("call", 2, CallPool) is pool  # kept for later shards


def test_the_flows_budget_is_its_nodes_and_the_setting_is_left_alone(monkeypatch):
    """What sizes itself from the budget (fetch's downloader processes) follows the flow's
    `workers` parameter through the node the flow passes, and the setting stays as it was: no
    side channel through the environment."""
    monkeypatch.setenv("SDPIPE_WORKERS", "5")
    monkeypatch.delenv("SDPIPE_FETCH_PROCESSES", raising=False)
    node = Node(12)
    assert node.workers == 12
    assert concurrency.fetch_parallelism(node.workers)[0] == 12
    assert concurrency.workers() == 5
