"""A build-latents run's agents on the shared local Ray cluster (flows/execution/cluster.py), called
directly with small units (shell commands that say which node ran them) instead of a flow: a
poison shard fails alone while its node and the other shards go on; a node that joins mid-run
takes shards; waiting for an agent says so and ends at its deadline."""

from __future__ import annotations

import functools
import logging
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flows.execution import cluster_agents
from flows.execution.cluster import Cluster, ClusterError, ShardKilledAgent

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def said() -> list[str]:
    """What the cluster's modules log (to the run's log where there is a run)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    loggers = [
        logging.getLogger(n) for n in ("flows.execution.cluster", "flows.execution.cluster_agents")
    ]
    for logger in loggers:
        logger.addHandler(handler)
    yield lines
    for logger in loggers:
        logger.removeHandler(handler)


def node_after(seconds: float):
    """A unit that waits `seconds` and returns the name of the node that ran it."""
    command = f'sleep {seconds}; printf %s "$SDPIPE_NODE"'
    return on_node(functools.partial(subprocess.check_output, ["sh", "-c", command], text=True))


def on_node(fn):
    """A unit (it is given the node that runs it) of `fn`, which needs nothing of the node."""
    return functools.partial(_call_alone, fn)


def _call_alone(fn, node):
    return fn()


def run_all(cluster: Cluster, units: dict) -> dict:
    """Every unit at once (in this order), as a stage's shard task runs: result or error."""
    with ThreadPoolExecutor(len(units)) as pool:
        futures = {s: pool.submit(cluster.unit("shards", fn, s)) for s, fn in units.items()}
    return {s: f.exception() or f.result() for s, f in futures.items()}


def test_a_poison_shard_fails_alone_and_the_run_goes_on(cluster, tmp_path, said):
    pids = tmp_path / "grandchildren"
    # SIGKILLs the agent running it (as the OOM killer would), leaving a grandchild behind.
    poison = on_node(
        functools.partial(
            subprocess.run,
            ["sh", "-c", f"sleep 0.3; sleep 1000 & echo $! >> {pids}; kill -9 $PPID; wait"],
        )
    )
    with Cluster(cluster.address, workers=2) as nodes:
        nodes.limits(lambda budget, devices: {"shards": 3})
        units = {f"ok{i}": node_after(1.5) for i in range(5)}
        units["poison"] = poison  # last: on a node with an innocent shard in flight
        results = run_all(nodes, units)

        error = results.pop("poison")
        assert isinstance(error, ShardKilledAgent), error
        assert "shard poison" in str(error) and "2 times" in str(error), error
        assert "its process died" in str(error), error
        # Its node has no fatal-signal report and counted no OOM kill: it says so.
        assert "no fatal signal reported, no OOM kill counted: a SIGKILL" in str(error), error
        names = {n.name for n in nodes.nodes}
        assert set(results.values()) <= names, results  # every innocent shard finished
        assert nodes.lost() == []
        assert sum("cpu agent died" in line for line in said) == 3, said
        assert not any(" lost " in line for line in said), said
        # The innocent shard in flight with the poison ran again alone on the poison's node.
        (victim,) = [n for n in names if f"on node {n} " in str(error)]
        assert victim in results.values(), results
    # What the dead agents left (the poison's grandchildren) is gone.
    left = [pid for pid in Path(pids).read_text().split() if Path(f"/proc/{pid}/cmdline").exists()]
    assert [p for p in left if Path(f"/proc/{p}/cmdline").read_bytes()] == []


def _crash() -> None:
    """A native crash in the agent's own process (as a decoder reading past its buffer)."""
    import ctypes

    ctypes.string_at(0)


def test_a_shard_that_crashes_its_agent_is_named_with_the_signal_and_where(cluster, said):
    with Cluster(cluster.address, workers=2) as nodes:
        nodes.limits(lambda budget, devices: {"shards": 1})
        error = run_all(nodes, {"segv": on_node(_crash)})["segv"]
        assert isinstance(error, ShardKilledAgent), error
        # Ray says "connection error code 2" for this as for a SIGKILL; the node tells more.
        assert str(error).count("Segmentation fault in string_at (__init__.py:") == 2, error
        assert ", from _crash (test_cluster_agents.py:" in str(error), error
        assert "a fatal signal, as its faulthandler reported" in str(error), error
        assert sum("agent died (Segmentation fault" in line for line in said) == 3, said
        # The whole report, every frame, in the run's log.
        reports = [line for line in said if "fatal-signal report" in line]
        assert len(reports) == 3 and all("in _call_alone" in r for r in reports), reports
        assert nodes.lost() == []


def test_a_node_that_joins_mid_run_takes_shards(cluster, monkeypatch):
    from flows.execution import cluster as cluster_module

    monkeypatch.setattr(cluster_module, "NODES_EVERY_S", 0.5)
    joined = None
    try:
        with Cluster(cluster.address, workers=2) as nodes:
            limits = nodes.limits(lambda budget, devices: {"shards": 2})
            assert limits["shards"]() == 2 * len(cluster.nodes)
            run_all(nodes, {f"a{i}": node_after(0) for i in range(3)})
            joined = cluster.add()
            ran = run_all(nodes, {f"b{i}": node_after(1) for i in range(8)})
            assert any(name.endswith(joined[:6]) for name in ran.values()), ran
            assert limits["shards"]() == 2 * len(cluster.nodes)
    finally:
        if joined is not None:
            cluster.kill(joined)  # the cluster as the test found it


def _serve_saying_gpus(node, device, shards):
    """A GPU stage's worker: each shard's result is the node and the GPUs Ray gave its agent."""
    import os
    import time

    for shard in shards:
        time.sleep(0.1)
        yield shard, (os.environ["SDPIPE_NODE"], os.environ.get("CUDA_VISIBLE_DEVICES", ""))


def _free_gpus() -> float:
    import ray

    return ray.available_resources().get("GPU", 0)


def _wait_for(condition, seconds: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_run_holds_a_nodes_gpus_only_while_a_gpu_stage_runs(cluster, monkeypatch):
    """And tells Ray's autoscaler what it uses: each node's CPUs, the GPUs while a GPU stage
    runs, one node more while every node is at its limit; nothing once it ends."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler import sdk

    from flows.execution import cluster as cluster_module

    monkeypatch.setattr(cluster_module, "NODES_EVERY_S", 0.0)  # the demand told at every pick
    asked: list[list[dict]] = []  # each demand the run told, in order
    request = sdk.request_resources

    def told(bundles):
        asked.append(bundles)
        request(bundles=bundles)  # on to the cluster, as in a run

    monkeypatch.setattr(sdk, "request_resources", told)
    gpu_node = cluster.add(gpus=1)
    try:
        with Cluster(cluster.address, workers=2) as nodes:
            nodes.limits(lambda budget, devices: {"shards": 1, "encode": 2})
            (gpu_name,) = [n.name for n in nodes.nodes if n.node_id == gpu_node]
            ran = run_all(nodes, {f"c{i}": node_after(0.5) for i in range(6)})
            assert gpu_name in ran.values(), ran  # a CPU stage's shard ran there...
            assert _free_gpus() == 1  # ...by an agent holding no GPU
            each = [{"CPU": 2}] * len(nodes.nodes)
            assert each + [{"CPU": 2}] in asked, asked  # 6 shards on 4 nodes of 1: one more
            with nodes.devices("encode", "encode-test", _serve_saying_gpus) as stage:
                with ThreadPoolExecutor(8) as pool:
                    results = list(pool.map(stage.run, [f"{i:05d}" for i in range(8)]))
                assert (gpu_name, "0") in results, results  # its agent was given the GPU
                assert _free_gpus() == 0  # and holds it while the stage runs
                assert any({"CPU": 2, "GPU": 1} in bundles for bundles in asked), asked
            # The stage closed: its agents ended, the GPU is free for other runs.
            assert _wait_for(lambda: _free_gpus() == 1), _free_gpus()
            # The run goes on with its CPU agents, holding no GPU and asking for none.
            run_all(nodes, {f"d{i}": node_after(0) for i in range(2)})
            assert _free_gpus() == 1
            assert asked[-1] == each, asked[-1]
        # The run's demand withdrawn where the autoscaler reads it.
        import ray
        from ray.experimental.internal_kv import _internal_kv_get

        ray.init(address=cluster.address, log_to_driver=False)
        try:
            assert asked[-1] == []
            assert _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) == b"[]"
        finally:
            ray.shutdown()
    finally:
        cluster.kill(gpu_node)  # the cluster as the test found it


def test_waiting_for_an_agent_says_who_holds_the_node_and_fails_at_its_deadline(
    cluster, monkeypatch, said
):
    """As a score stage's agent waits for GPUs another run holds: here the node's CPUs."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    monkeypatch.setattr(cluster_agents, "TELL_EVERY_S", 1.0)
    monkeypatch.setenv("SDPIPE_CLUSTER_WAIT_S", "3")
    node_id = cluster.node_ids()[0]
    pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)

    @ray.remote
    class Holder:  # defined here: pickled whole, the nodes need not import this module
        def ready(self) -> bool:
            return True

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        holder = Holder.options(name="other-run", num_cpus=2, scheduling_strategy=pinned).remote()
        ray.get(holder.ready.remote())
        waiting = Holder.options(num_cpus=1, scheduling_strategy=pinned).remote()
        with pytest.raises(ClusterError) as failed:
            cluster_agents.wait_ready(
                waiting.ready.remote(), "the test's agent", node_id, lambda: True, set
            )
    finally:
        ray.shutdown()
    message = str(failed.value)
    assert "for the test's agent (SDPIPE_CLUSTER_WAIT_S=3)" in message, message
    assert "free there: CPU 0 of 2" in message and "other-run" in message, message
    told = "s for the test's agent (limit 3 s): free there: CPU 0 of 2"
    assert any(told in line for line in said), said
