"""Where a build's shard work runs: one executor interface, two kinds: this node
(`LocalExecutor`) or the nodes of a Ray cluster (`RayExecutor`, flows/execution/cluster.py).

The build asks its executor four things and never which kind it has: `limits(node_limits)`
(per stage, its shard task runs at once, from each node's budget and devices), `unit(stage,
fn, shard)` (a CPU stage's unit, `fn(node)`, as a callable that runs it on a node, given that
node's `Node`), `devices(stage, name, serve, release)` (a GPU stage's workers, `serve(node,
device, shards)` on every device) and `describe()`. The executor owns placement and limits;
the shard records (tasks/runtime/shards.py) stay the one completion mechanism, and each
record names the node that wrote it (the per-node counts of the dashboard's tables).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from flows.execution.cluster import Cluster, cluster_address
from flows.execution.devices import Devices
from tasks.runtime.node import Node, local_node
from tasks.runtime.shards import ShardStats

RayExecutor = Cluster


class LocalExecutor:
    """This node: every unit in this process on `node` (its pools, within its budget), a GPU
    stage on a `Devices` over the node's devices."""

    def __init__(self, node: Node):
        self.node = node

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc) -> None:
        """The node's pools stay for the process's next run (they start in seconds)."""

    def describe(self) -> str:
        return f"this node, {self.node.workers} workers, devices {', '.join(self.node.devices)}"

    def limits(self, node_limits: Callable[[int, int], dict[str, int]]) -> dict[str, int]:
        return node_limits(self.node.workers, len(self.node.devices))

    def unit(
        self, stage: str, fn: Callable[[Node], ShardStats], shard: str = ""
    ) -> Callable[[], ShardStats]:
        return functools.partial(fn, self.node)

    def devices(self, stage: str, name: str, serve, release=None) -> Devices:
        node = self.node
        return Devices(
            name, functools.partial(serve, node), lanes=len(node.devices), release=release
        )


Executor = LocalExecutor | RayExecutor  # what the build is given: it asks no more than above


def executor(cluster: str | None = None, workers: int | None = None):
    """The executor of a build: the Ray cluster at `cluster` (else `RAY_ADDRESS`; its agents
    started, `workers` each, default their node's CPUs), else this node with the budget
    `workers` (default `SDPIPE_WORKERS`, else the cores). A context manager."""
    address = cluster_address(cluster)
    if address is None:
        return LocalExecutor(local_node(workers))
    return RayExecutor(address, workers=workers)
