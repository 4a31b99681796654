"""A multi-node Ray cluster on this machine, for the cluster tests (issue 27).

Ray's own test utility (`ray.cluster_utils.Cluster`): a head node with no CPUs (it schedules,
it runs nothing) and worker nodes, each its own raylet with its own CPUs, all on this
machine's address (Ray's default: its client does not follow a cluster pinned to 127.0.0.1).
A node can be killed (`kill`) as a lost machine would be, and another added. Start-up is ~7 s
for three nodes on a 2-core machine: tests share one cluster per test process (`cluster`
marker, the `ray_cluster` fixture in tests/conftest.py), and each test leaves it with as many
nodes as it found.

The test process itself does not connect: the flows under test connect to `address` (as a
user's flow run connects to `RAY_ADDRESS`) and disconnect when they end. The cluster has token
authentication on, as users' clusters have it (Ray's default from 2.61): a fresh token in a
temporary folder (never the user's ~/.ray), set for this process and so for the nodes it starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

NODE_CPUS = 2
AUTH_SETTINGS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def reload_auth() -> None:
    """This process's Ray reads its authentication settings (RAY_AUTH_*) again: it keeps what it
    read first."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    reset_auth_token_state()


def set_auth(settings: dict[str, str | None]) -> dict[str, str | None]:
    """Set (None: unset) Ray's authentication settings for this process and the processes it
    starts; returns the ones they replaced."""
    saved = {k: os.environ.get(k) for k in AUTH_SETTINGS}
    for k, v in settings.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    reload_auth()
    return saved


class LocalCluster:
    def __init__(self, nodes: int, *, cpus: int = NODE_CPUS):
        from ray._private.authentication.authentication_token_generator import (
            generate_new_authentication_token,
        )
        from ray.cluster_utils import Cluster

        self.cpus = cpus
        self.auth_dir = Path(tempfile.mkdtemp(prefix="ray-auth-"))
        token = self.auth_dir / "auth_token"
        token.write_text(generate_new_authentication_token())
        self.saved_auth = set_auth(
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": None, "RAY_AUTH_TOKEN_PATH": str(token)}
        )
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
            },
        )
        # Ray's utility writes the head's address where a plain `ray.init()` looks for "the
        # cluster started on this machine" (/tmp/ray/ray_current_cluster): other tests' local Ray
        # (encode-ray, generate on Ray) would then join this cluster. It is forgotten here; the
        # flows under test are given `address`.
        from ray._common.utils import reset_ray_address

        reset_ray_address()
        self.nodes = [self._add() for _ in range(nodes)]
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self.cluster.address

    def _add(self, gpus: int = 0):
        # Ray's GPUs are resources it counts: a node may say it has one where torch has none.
        return self.cluster.add_node(num_cpus=self.cpus, num_gpus=gpus)

    def node_ids(self) -> list[str]:
        """The worker nodes' Ray node ids, in the order they were added."""
        return [n.node_id for n in self.nodes]

    def kill(self, node_id: str) -> None:
        """Kill a worker node's raylet and its workers, as a lost machine."""
        (node,) = [n for n in self.nodes if n.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def add(self, gpus: int = 0) -> str:
        node = self._add(gpus)
        self.nodes.append(node)
        self.cluster.wait_for_nodes()
        return node.node_id

    def ensure(self, nodes: int) -> None:
        """Back to `nodes` worker nodes (after a test killed some)."""
        while len(self.nodes) < nodes:
            self.add()

    def shutdown(self) -> None:
        self.cluster.shutdown()
        set_auth(self.saved_auth)
        shutil.rmtree(self.auth_dir, ignore_errors=True)


@contextlib.contextmanager
def local_cluster(nodes: int, *, cpus: int = NODE_CPUS) -> Iterator[LocalCluster]:
    started = time.monotonic()
    cluster = LocalCluster(nodes, cpus=cpus)
    print(f"local Ray cluster of {nodes} nodes up in {time.monotonic() - started:.1f} s")
    try:
        yield cluster
    finally:
        cluster.shutdown()
