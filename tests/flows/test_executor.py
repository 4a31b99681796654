"""One executor interface, two kinds: the build asks this node the same things it asks a Ray
cluster (flows/execution/executor.py); here this node's answers."""

from __future__ import annotations

from flows.build_latents import stage_limits
from flows.execution.executor import LocalExecutor, executor
from tasks.runtime.node import Node, local_node


def _serve(node, device, shards):
    yield from ()


def test_this_node_gives_units_its_node_limits_from_its_budget_and_a_lane_per_device(
    monkeypatch,
):
    monkeypatch.setenv("SDPIPE_DEVICES", "cpu,cpu")  # two devices, as two GPUs
    node = Node(3)
    with LocalExecutor(node) as nodes:
        assert nodes.limits(stage_limits) == stage_limits(3, 2)
        assert nodes.unit("tokens", lambda given: given, "00000")() is node
        with nodes.devices("scores", "score-web", _serve) as workers:
            assert len(workers) == 2
        assert "3 workers" in nodes.describe() and "cpu:1" in nodes.describe()


def test_without_a_cluster_the_build_runs_on_this_processs_node(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    chosen = executor(None, 3)
    assert isinstance(chosen, LocalExecutor) and chosen.node is local_node(3)
