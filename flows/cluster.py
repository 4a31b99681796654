"""build-latents over a Ray cluster: every per-shard stage's work on the cluster's nodes.

Given a cluster (`build-latents`' `cluster` parameter, `sdpipe build-latents --cluster ADDRESS`,
else `RAY_ADDRESS`), the flow run stays where it is, with one Prefect task run per shard (its
cache key, record, retries, "rerun only the failed shards", the dashboard's counts); only each
shard's work moves, to a node of the cluster. Without a cluster nothing changes.

Each node of the cluster with CPUs runs one `NodeAgent` for the flow run: a Ray actor pinned to
the node (node affinity, not soft), holding the node's GPUs, with the node's settings in its
environment (`SDPIPE_WORKERS`: the node's worker budget, the flow's `workers` or the node's
CPUs; `SDPIPE_NODE`: its name in records; `SDPIPE_GPU_POOL`: its GPU pool). In that one process
live what one node's stages keep between shards, exactly as in a one-node flow run: the fetch
pool (img2dataset downloader processes), the decode pool (repack, encode's decoders), tokenize's
processes, and for score and encode one long-lived worker per GPU (`flows.devices.Devices`,
built in the agent: the node's GPUs, its pool's slots and device locks). Per stage, a shard goes
to the node with the most room under that node's own limit (`stage_limits` of its budget and
devices), so every node works at its one-node pace.

A lost node costs only its shards: a call on an agent whose node died raises `RayActorError`;
the shard's task run (still running, in the flow's process) then hands the shard to another
node, and the node is left out for the rest of the run. Outputs are written under temporary
names and renamed into place (sdtrain/atomic.py), so a shard the lost node was writing leaves
nothing a rerun trusts; finished shards have their records and are never redone.

The data root must be one path on every node (a shared filesystem), as for the workers of
docs/scale-out.md; so must the code (the agents import the checkout the flow runs from).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tasks.runtime.net import node_env
from tasks.runtime.ray_connect import connect, disconnect
from tasks.runtime.shards import ShardStats, current_node

log = logging.getLogger(__name__)

# A shard task's call on an agent waits as long as its work takes (a GPU shard waits for its
# lane): no timeout here; a lost node ends the call with RayActorError.
AGENT_CONCURRENCY = 1024


class ClusterError(Exception):
    """The cluster cannot run the build (no address answers, no node has CPUs, every node was
    lost); the message says which and what to do. A retry of the flow run cannot fix it while
    the cluster stays as it is."""


def cluster_address(cluster: str | None) -> str | None:
    """The cluster a build runs on: the argument, else `RAY_ADDRESS`, else none (this node)."""
    return cluster or os.environ.get("RAY_ADDRESS") or None


def forwarded_env() -> dict[str, str]:
    """This process's settings every node needs (`net.node_env`: sdpipe's, paths absolute, the
    checkout on PYTHONPATH) and the Prefect API it reports to, from the environment or the
    active Prefect profile: nodes report to the same server."""
    from prefect.settings import get_current_settings

    env = node_env()
    api = get_current_settings().api
    if api.url:
        env["PREFECT_API_URL"] = api.url
    if api.key:
        env["PREFECT_API_KEY"] = api.key.get_secret_value()
    if api.auth_string:
        env["PREFECT_API_AUTH_STRING"] = api.auth_string.get_secret_value()
    return env


def train_on_nodes(config, *, nodes: int, cluster: str, on_line) -> dict:
    """A training on `nodes` nodes of the Ray cluster (`launch_training_on_nodes`), its ranks
    given this flow's settings and Prefect API (`forwarded_env`): the curriculum's and the
    finetune flow's launcher beyond one node."""
    from tasks.phases.train_nodes import launch_training_on_nodes

    return launch_training_on_nodes(
        config, nodes=nodes, cluster=cluster, on_line=on_line, env=forwarded_env()
    )


class NodeAgent:
    """One node's worker for one build-latents run (a Ray actor; see the module docstring)."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        self.devices: dict[str, Any] = {}
        self.lock = threading.Lock()

    def ready(self) -> dict:
        from flows import pools

        return {"node": current_node(), "pid": os.getpid(), "devices": pools.node_devices()}

    def run(self, unit: Callable[[], ShardStats]) -> ShardStats:
        """One shard's unit of a CPU stage (fetch, repack, tokenize), in this process."""
        return unit()

    def serve(self, stage: str, name: str, serve, release, shard: str) -> ShardStats:
        """One shard of a GPU stage (score, encode) through this node's `Devices` for it: one
        worker per device, its model built once, kept for the stage's later shards."""
        from flows.devices import Devices

        with self.lock:
            devices = self.devices.get(stage)
            if devices is None:
                devices = self.devices[stage] = Devices(name, serve, release=release)
        return devices.run(shard)

    def close(self, stage: str) -> None:
        """The stage has no more shards: its workers give their devices back."""
        with self.lock:
            devices = self.devices.pop(stage, None)
        if devices is not None:
            devices.close()


@dataclass
class Node:
    """A node of the cluster as the flow sees it."""

    name: str
    node_id: str
    index: int
    budget: int  # its worker budget (SDPIPE_WORKERS there)
    devices: int  # GPU lanes (GPUs; 1 on a node without: `cpu:0`)
    agent: Any = None
    lost: str | None = None  # why it was left out
    running: Counter = field(default_factory=Counter)  # per stage, shards it works on now


def _names(nodes: list[dict]) -> list[str]:
    """Each node's name: its host name, with its Ray node id's start where several nodes share
    a host (several raylets on one machine)."""
    hosts = Counter(n["NodeManagerHostname"] for n in nodes)
    return [
        n["NodeManagerHostname"]
        if hosts[n["NodeManagerHostname"]] == 1
        else f"{n['NodeManagerHostname']}-{n['NodeID'][:6]}"
        for n in nodes
    ]


class Cluster:
    """The nodes of a Ray cluster working for one build-latents run; see the module docstring.

    `unit(stage, fn)`: a stand-in for the shard unit `fn` that runs it on a node;
    `devices(stage, name, serve, release)`: a stand-in for a `Devices` of the GPU stage that
    deals each shard to a node's. `limits(...)`: per stage, the shard task runs at once, the
    sum of every node's."""

    def __init__(self, address: str, *, workers: int | None = None):
        self.address = address
        self.lock = threading.Lock()
        self.per_node: dict[str, dict[str, int]] = {}
        self.turns: Counter = Counter()
        self.nodes: list[Node] = []
        # This cluster, or an error naming why not (another one already connected, its token).
        self.connected = connect(
            address, error=ClusterError, log_to_driver=False, logging_level=logging.WARNING
        )
        try:
            self._start(workers)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, workers: int | None) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]
        if not alive:
            raise ClusterError(
                f"the Ray cluster at {self.address} has no live node with CPUs: start its "
                "worker nodes (`ray start --address HEAD:6379`)"
            )
        env = forwarded_env()
        remote = ray.remote(NodeAgent)
        nodes = self.nodes
        for name, n in zip(_names(alive), alive, strict=True):
            gpus = int(n["Resources"].get("GPU", 0))
            budget = workers or int(n["Resources"]["CPU"])
            node_env = {
                **env,
                "SDPIPE_WORKERS": str(budget),
                "SDPIPE_NODE": name,
                "SDPIPE_GPU_POOL": os.environ.get("SDPIPE_GPU_POOL") or name,
            }
            node = Node(name, n["NodeID"], len(nodes), budget, max(1, gpus))
            node.agent = remote.options(
                num_cpus=0,
                num_gpus=gpus,
                max_concurrency=AGENT_CONCURRENCY,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                runtime_env={"env_vars": node_env},
            ).remote(node_env)
            nodes.append(node)
        for node, info in zip(nodes, ray.get([n.agent.ready.remote() for n in nodes]), strict=True):
            log.info("node %s: %d workers, devices %s", node.name, node.budget, info["devices"])

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """End the agents (their pools and workers with them), and disconnect if this opened
        the connection."""
        import ray

        for node in self.nodes:
            if node.agent is not None:
                ray.kill(node.agent, no_restart=True)
        if self.connected:
            disconnect()

    def describe(self) -> str:
        return ", ".join(
            f"{n.name} ({n.budget} workers, {n.devices} device{'s' * (n.devices > 1)})"
            for n in self.nodes
        )

    # ---- stage limits --------------------------------------------------------------------

    def limits(self, limits: Callable[[int, int], dict[str, int]]) -> dict[str, int]:
        """Per stage, the sum over the nodes of `limits(budget, devices)`, each node's limits
        as a one-node run of it would have them (kept: a node takes at most its own)."""
        self.per_node = {n.name: limits(n.budget, n.devices) for n in self.nodes}
        total: Counter = Counter()
        for per_node in self.per_node.values():
            total.update(per_node)
        return dict(total)

    # ---- dispatch ------------------------------------------------------------------------

    def unit(self, stage: str, fn: Callable[[], ShardStats]) -> Callable[[], ShardStats]:
        """`fn` (a shard's unit of a CPU stage) as a callable that runs it on a node."""
        return functools.partial(self._call, stage, lambda agent: agent.run.remote(fn))

    def devices(self, stage: str, name: str, serve, release=None) -> ClusterDevices:
        return ClusterDevices(self, stage, name, serve, release)

    def _pick(self, stage: str) -> Node:
        """The live node with the most room for one more shard of `stage` (free slots under
        its limit, then the fewest running); fails when every node was lost."""
        with self.lock:
            live = [n for n in self.nodes if n.lost is None]
            if not live:
                lost = "; ".join(f"{n.name}: {n.lost}" for n in self.nodes)
                raise ClusterError(
                    f"every node of the Ray cluster at {self.address} was lost ({lost}): "
                    "bring nodes back and rerun the flow run (finished shards are kept)"
                )

            turn, count = self.turns[stage], len(self.nodes)

            def room(n: Node) -> tuple:
                limit = max(1, self.per_node.get(n.name, {}).get(stage, 1))
                # Ties in turn, so shards spread over the nodes whatever order they finish in.
                return (
                    n.running[stage] - limit,
                    n.running[stage] / limit,
                    (n.index - turn) % count,
                )

            node = min(live, key=room)
            node.running[stage] += 1
            self.turns[stage] = node.index + 1
            return node

    def _call(self, stage: str, submit: Callable[[Any], Any]) -> ShardStats:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        while True:
            node = self._pick(stage)
            try:
                return ray.get(submit(node.agent))
            except RayTaskError as e:  # the shard's own failure: raised as on one node
                raise (e.cause if isinstance(e.cause, BaseException) else e) from None
            except RayActorError as e:
                self._lose(node, e)
            finally:
                with self.lock:
                    node.running[stage] -= 1

    def _lose(self, node: Node, error: BaseException) -> None:
        """The node's agent is gone (its node died, or its process): leave the node out and
        make sure the agent is dead before its shards go elsewhere."""
        import ray

        with self.lock:
            if node.lost is not None:
                return
            node.lost = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        log.warning("node %s lost (%s): its shards run on the other nodes", node.name, node.lost)
        with contextlib.suppress(Exception):  # already gone with its node
            ray.kill(node.agent, no_restart=True)

    def close_stage(self, stage: str) -> None:
        """Every node's workers of a GPU stage give their devices back."""
        import ray

        live = [n for n in self.nodes if n.lost is None]
        for node, ref in [(n, n.agent.close.remote(stage)) for n in live]:
            try:
                ray.get(ref)
            except Exception as e:  # a node lost as the stage ends: nothing to give back
                log.warning("node %s: closing %s: %s", node.name, stage, e)

    def lost(self) -> list[str]:
        return [n.name for n in self.nodes if n.lost is not None]


class ClusterDevices:
    """A GPU stage over every node's devices: `run(shard)` as `Devices.run`, the shard dealt
    to a node whose agent deals it to one of its devices' workers."""

    def __init__(self, cluster: Cluster, stage: str, name: str, serve, release):
        self.cluster, self.stage, self.name = cluster, stage, name
        self.serve, self.release = serve, release

    def __enter__(self) -> ClusterDevices:
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.close_stage(self.stage)

    def run(self, shard: str) -> ShardStats:
        args = (self.stage, self.name, self.serve, self.release, shard)
        return self.cluster._call(self.stage, lambda agent: agent.serve.remote(*args))
