"""build-latents over a Ray cluster: every per-shard stage's work on the cluster's nodes.

Given a cluster (`build-latents`' `cluster` parameter, `sdpipe build-latents --cluster ADDRESS`,
else `RAY_ADDRESS`), the flow run stays where it is, with one Prefect task run per shard (its
cache key, record, retries, "rerun only the failed shards", the dashboard's counts); only each
shard's work moves, to a node of the cluster. Without a cluster nothing changes.

Each node of the cluster with CPUs runs one CPU `NodeAgent` for the flow run: a Ray actor
pinned to the node (node affinity, not soft), asking Ray for no CPUs and no GPUs, with the
node's settings in its environment (`SDPIPE_WORKERS`: the node's worker budget, the flow's
`workers` or the node's CPUs; `SDPIPE_NODE`: its name in records; `SDPIPE_GPU_POOL`: its GPU
pool). It builds the node's `Node` (tasks/runtime/node.py) and gives it to every unit it runs:
in it live what one node's CPU stages keep between shards, as in a one-node run (the fetch
pool, the decode pool, tokenize's processes), within the node's budget. A GPU stage (score,
encode) gets its own agent per node at its first shard there, holding the node's GPUs and its
`Devices` (one long-lived worker per GPU), ended by `close_stage`: GPUs are held only while
the stage runs.
Per stage, a shard goes to the node with the most room under that node's own limit
(`stage_limits` of its budget and devices); a node that joins mid-run gets an agent and adds
its limits. Waiting for an agent to start says so and who holds the node, and fails after
`SDPIPE_CLUSTER_WAIT_S` (flows/execution/cluster_agents.py); the run's demand goes to Ray's
autoscaler.

A dead agent is not a lost node: Ray is asked whether the node is alive. A lost node costs only
its shards (their task runs hand them to other nodes; the node is left out). On a live node a
fresh agent, after killing what the dead one left, runs each shard that was in flight alone;
a shard that kills `POISON_DEATHS` agents running it alone fails naming how they died (their
nodes' death notes: a fatal signal and where, or OOM kills; death_notes.py), and the
other shards go on. Outputs are written under temporary names and renamed into place, so a
shard a dead agent was writing leaves nothing a rerun trusts.

The data root must be one path on every node (a shared filesystem), as for the workers of
docs/scale-out.md; so must the code (the agents import the checkout the flow runs from).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from flows.execution.cluster_agents import (
    CLEAR_S,
    CPU,
    POLL_S,
    ClusterError,
    Node,
    NodeAgent,
    NodeGone,
    Seat,
    ShardKilledAgent,
    clear_task,
    death_note,
    how_it_died,
    names,
    on_node,
    tell,
    usable,
    wait_ready,
    who,
)
from tasks.runtime.net import node_env
from tasks.runtime.ray_connect import connect, disconnect
from tasks.runtime.shards import ShardStats

log = logging.getLogger(__name__)

# A shard task's call on an agent waits as long as its work takes (a GPU shard waits for its
# lane): no timeout here; a lost node ends the call with RayActorError.
AGENT_CONCURRENCY = 1024
NODES_EVERY_S = 2.0  # how often a shard's pick reads Ray's node list for nodes that joined
POISON_DEATHS = 2  # a shard fails once it killed this many agents that ran it alone

__all__ = ["Cluster", "ClusterError", "ShardKilledAgent", "cluster_address", "train_on_nodes"]


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


class Cluster:
    """The nodes of a Ray cluster working for one build-latents run; see the module docstring.

    `unit(stage, fn, shard)`: a stand-in for the shard unit `fn` that runs it on a node;
    `devices(stage, name, serve, release)`: a stand-in for a `Devices` of the GPU stage that
    deals each shard to a node's. `limits(...)`: per stage, the shard task runs at once, the
    sum of every live node's (read at each call: nodes join and leave)."""

    def __init__(self, address: str, *, workers: int | None = None):
        self.address = address
        self.workers = workers
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.per_node: dict[str, dict[str, int]] = {}
        self.node_limits: Callable[[int, int], dict[str, int]] | None = None
        self.turns: Counter = Counter()
        self.nodes: list[Node] = []
        self.run_id, self.who = uuid.uuid4().hex[:12], who()
        self.launched = 0  # agents started: each one's mark is unique
        self.listed_at = 0.0  # when Ray's node list was last read for nodes that joined
        self.saturated = False  # a pick found every node at its limit: more shards wait
        self.demand: list[dict] | None = None  # the bundles asked of Ray's autoscaler
        # This cluster, or an error naming why not (another one already connected, its token).
        self.connected = connect(
            address, error=ClusterError, log_to_driver=False, logging_level=logging.WARNING
        )
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        listed = self._listed()
        alive = [n for n in listed if usable(n)]
        if not alive:
            raise ClusterError(
                f"the Ray cluster at {self.address} has no live node with CPUs: start its "
                "worker nodes (`ray start --address HEAD:6379`)"
            )
        self.env = forwarded_env()
        with self.lock:
            for n in alive:
                self._join(n, listed)
        for node in list(self.nodes):
            self._ready(node.seats[CPU])
        self.listed_at = time.monotonic()

    def _listed(self) -> list[dict]:
        import ray

        return ray.nodes()

    def _join(self, n: dict, listed: list[dict]) -> Node:
        """A node of Ray's list into the run: its CPU agent started (under the lock)."""
        name = dict(zip((m["NodeID"] for m in listed), names(listed), strict=True))[n["NodeID"]]
        if any(m.name == name for m in self.nodes):  # a second raylet on a known host
            name = f"{n['NodeManagerHostname']}-{n['NodeID'][:6]}"
        budget = self.workers or int(n["Resources"]["CPU"])
        env = {
            **self.env,
            "SDPIPE_WORKERS": str(budget),
            "SDPIPE_NODE": name,
            "SDPIPE_GPU_POOL": os.environ.get("SDPIPE_GPU_POOL") or name,
        }
        node = Node(
            name, n["NodeID"], len(self.nodes), budget, int(n["Resources"].get("GPU", 0)), env
        )
        if self.node_limits is not None:
            self.per_node[name] = self.node_limits(node.budget, node.devices)
        node.seats[CPU] = seat = Seat(node, CPU)
        self._launch(seat)
        self.nodes.append(node)
        return node

    def _launch(self, seat: Seat) -> None:
        """A fresh agent for the seat (under the lock): it first clears what the node's dead
        agents left there. Its `ready` is waited on by the shards that go to it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = seat.node
        self.launched += 1
        seat.mark = f"{self.run_id}-{self.launched}"
        gpus = 0 if seat.role == CPU else node.gpus  # GPUs only while a GPU stage runs
        dead, node.dead = node.dead, []
        seat.agent = (
            ray.remote(NodeAgent)
            .options(
                name=f"sdpipe {self.who} {seat.role} {node.name} {seat.mark}",
                num_cpus=0,
                num_gpus=gpus,
                max_concurrency=AGENT_CONCURRENCY,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                runtime_env={"env_vars": node.env},
            )
            .remote(node.env, seat.mark, dead)
        )
        seat.ready = seat.agent.ready.remote()
        seat.used = False

    def _ready(self, seat: Seat) -> None:
        """Wait (with the deadline, saying so) until the seat's agent has started."""
        ref, node = seat.ready, seat.node
        if ref is None:
            return
        gpus = f" with its {node.gpus} GPU(s)" if seat.role != CPU and node.gpus else ""
        info = wait_ready(
            ref,
            f"the {seat.role} agent of node {node.name}{gpus}",
            node.node_id,
            functools.partial(self._alive, node.node_id),
            self._own,
        )
        with self.lock:
            if seat.ready is ref:
                seat.ready = None
                log.info(
                    "node %s: %s agent up, %d workers, devices %s%s",
                    node.name,
                    seat.role,
                    node.budget,
                    info["devices"],
                    f", {info['cleared']} processes of a dead agent cleared"
                    if info["cleared"]
                    else "",
                )

    def _alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in self._listed())

    def _own(self) -> set[str]:
        with self.lock:
            return {
                s.agent._actor_id.hex()
                for n in self.nodes
                for s in n.seats.values()
                if s.agent is not None
            }

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """End the agents (their pools and workers with them), clear what dead agents left on
        live nodes, withdraw the run's demand, and disconnect if this opened the connection."""
        import ray

        if not ray.is_initialized():
            return
        for node in self.nodes:
            for seat in node.seats.values():
                if seat.agent is not None:
                    with contextlib.suppress(Exception):
                        ray.kill(seat.agent, no_restart=True)
        clears = [self._clear(n, self.run_id) for n in self.nodes if n.lost is None]
        if clears:
            ray.wait(clears, num_returns=len(clears), timeout=CLEAR_S)
        if self.demand:
            from ray.autoscaler.sdk import request_resources

            with contextlib.suppress(Exception):
                request_resources(bundles=[])
        if self.connected:
            disconnect()

    def _clear(self, node: Node, run: str):
        return on_node(node, clear_task).remote(node.dead, run)

    def describe(self) -> str:
        return f"the Ray cluster at {self.address}: " + ", ".join(
            f"{n.name} ({n.budget} workers, {n.devices} device{'s' * (n.devices > 1)})"
            for n in self.nodes
        )

    # ---- stage limits --------------------------------------------------------------------

    def limits(self, limits: Callable[[int, int], dict[str, int]]) -> dict[str, Callable]:
        """Per stage, a function giving the sum over the live nodes of `limits(budget,
        devices)`, each node's limits as a one-node run of it would have them (kept: a node
        takes at most its own); a node that joins adds its own."""
        with self.lock:
            self.node_limits = limits
            self.per_node = {n.name: limits(n.budget, n.devices) for n in self.nodes}
            stages = {s for per_node in self.per_node.values() for s in per_node}
        return {s: functools.partial(self.limit, s) for s in sorted(stages)}

    def limit(self, stage: str) -> int:
        """The stage's shard task runs at once now: at least 1, so that a stage whose nodes
        were all lost still tries one and fails saying so."""
        with self.lock:
            live = [n for n in self.nodes if n.lost is None]
            return max(1, sum(self.per_node.get(n.name, {}).get(stage, 1) for n in live))

    # ---- dispatch ------------------------------------------------------------------------

    def unit(
        self, stage: str, fn: Callable[[], ShardStats], shard: str = ""
    ) -> Callable[[], ShardStats]:
        """`fn` (the unit of `shard` of a CPU stage) as a callable that runs it on a node."""
        return functools.partial(self._call, stage, CPU, lambda agent: agent.run.remote(fn), shard)

    def devices(self, stage: str, name: str, serve, release=None) -> ClusterDevices:
        return ClusterDevices(self, stage, name, serve, release)

    def _take(self, stage: str, role: str, suspect: Seat | None) -> tuple[Seat, bool]:
        """The seat a shard goes to, and whether it runs there alone. A suspect (it was in
        flight when an agent died) waits for its seat to be idle and runs alone on a fresh
        agent; any other shard goes to the live node with the most room for one more shard of
        `stage` (free slots under its limit, then the fewest running) whose seat has no
        suspects to run. Fails when every node was lost."""
        with self.changed:
            while True:
                self._refresh()
                if suspect is not None and suspect.node.lost is None:
                    seat = suspect
                    if seat.solo or seat.busy:
                        self.changed.wait(POLL_S)
                        continue
                    seat.solo = True
                    if seat.agent is None or seat.used:
                        self._kill(seat)
                        self._launch(seat)
                    return self._seat(seat, stage), True
                seat = self._pick(stage, role)
                if seat is not None:
                    if seat.agent is None:
                        self._launch(seat)
                    return self._seat(seat, stage), False
                self.changed.wait(POLL_S)  # every live node runs suspects: soon free

    def _seat(self, seat: Seat, stage: str) -> Seat:
        seat.busy += 1
        seat.used = True
        seat.node.running[stage] += 1
        return seat

    def _pick(self, stage: str, role: str) -> Seat | None:
        live = [n for n in self.nodes if n.lost is None]
        if not live:
            lost = "; ".join(f"{n.name}: {n.lost}" for n in self.nodes)
            raise ClusterError(
                f"every node of the Ray cluster at {self.address} was lost ({lost}): "
                "bring nodes back and rerun the flow run (finished shards are kept)"
            )
        free = [
            n for n in live if (s := n.seats.get(role)) is None or (not s.suspects and not s.solo)
        ]
        if not free:
            return None
        turn, count = self.turns[stage], len(self.nodes)

        def room(n: Node) -> tuple:
            limit = max(1, self.per_node.get(n.name, {}).get(stage, 1))
            # Ties in turn, so shards spread over the nodes whatever order they finish in.
            return (
                n.running[stage] - limit,
                n.running[stage] / limit,
                (n.index - turn) % count,
            )

        node = min(free, key=room)
        self.turns[stage] = node.index + 1
        # Every node at its limit with this one: more of the stage's shards wait for room.
        self.saturated = room(node)[0] + 1 >= 0 and all(
            room(n)[0] >= 0 for n in live if n is not node
        )
        return node.seats.setdefault(role, Seat(node, role))

    def _refresh(self) -> None:
        """Every NODES_EVERY_S (under the lock): nodes that joined Ray's list get an agent,
        nodes it lists dead are lost, and the run's demand is told to Ray's autoscaler."""
        now = time.monotonic()
        if now - self.listed_at < NODES_EVERY_S:
            return
        self.listed_at = now
        listed = self._listed()
        known = {n.node_id: n for n in self.nodes}
        for n in listed:
            node = known.get(n["NodeID"])
            if node is None and usable(n):
                node = self._join(n, listed)
                tell(logging.INFO, "node %s joined the cluster: it takes shards", node.name)
            elif node is not None and not n["Alive"] and node.lost is None:
                self._lose_locked(node, "Ray lists it dead")
        self._ask()

    def _ask(self) -> None:
        """Ray's autoscaler sees the agents ask for no CPUs: tell it what the run uses (each
        live node's CPUs, and GPUs while a GPU stage runs), and one node more while every node
        is at its limit (`request_resources`; no autoscaler, no effect)."""
        from ray.autoscaler.sdk import request_resources

        live = [n for n in self.nodes if n.lost is None]
        gpu_stage = any(role != CPU for n in live for role in n.seats)
        bundles = [
            {"CPU": n.budget, **({"GPU": n.gpus} if gpu_stage and n.gpus else {})} for n in live
        ]
        if self.saturated and bundles:
            bundles.append(max(bundles, key=lambda b: (b.get("GPU", 0), b["CPU"])))
        if bundles != self.demand:
            request_resources(bundles=bundles)
            self.demand = bundles

    def _call(self, stage: str, role: str, submit: Callable[[Any], Any], shard: str) -> ShardStats:
        import ray
        from ray.exceptions import ActorUnschedulableError, RayActorError, RayTaskError

        suspect: Seat | None = None
        deaths: list[str] = []  # how each agent that ran it alone died
        while True:
            seat, alone = self._take(stage, role, suspect)
            agent, node = seat.agent, seat.node
            try:
                try:
                    self._ready(seat)
                except (RayActorError, ActorUnschedulableError, NodeGone) as e:  # the node
                    self._lose(node, f"its {role} agent could not start: {how_it_died(e)[1]}")
                    suspect = None
                    continue
                return ray.get(submit(agent))
            except RayTaskError as e:  # the shard's own failure: raised as on one node
                raise (e.cause if isinstance(e.cause, BaseException) else e) from None
            except RayActorError as e:
                lost, how = self._died(seat, agent, e)
                if lost:  # the shard goes elsewhere
                    suspect = None
                    continue
                if alone:
                    deaths.append(how)
                    if len(deaths) >= POISON_DEATHS:
                        raise ShardKilledAgent(
                            f"{stage} shard {shard or '?'} killed the agent that ran it alone "
                            f"on node {node.name} {len(deaths)} times ({'; '.join(deaths)}): "
                            "it fails, the other shards go on"
                        ) from None
                with self.lock:
                    seat.suspects += 1
                suspect = seat
            finally:
                with self.changed:
                    seat.busy -= 1
                    node.running[stage] -= 1
                    if alone:
                        seat.solo = False
                        seat.suspects -= 1
                    self.changed.notify_all()

    def _died(self, seat: Seat, agent: Any, error: BaseException) -> tuple[bool, str]:
        """An agent died under a shard: whether its node is lost (Ray says the node died, or
        no longer lists it alive), and how the agent died (its node's death note, read by the
        first shard to see the death). Else the agent's processes are cleared and a fresh one
        started by the next shard there (its suspects first)."""
        node_died, how = how_it_died(error)
        with self.lock:
            first = seat.agent is agent
            if first:
                seat.agent, seat.ready = None, None
                seat.node.dead.append(seat.mark)
                mark = seat.mark
        if node_died or not self._alive(seat.node.node_id):
            self._lose(seat.node, f"{type(error).__name__}: {how}")
            return True, how
        if first:
            note = death_note(seat.node, mark, how, self._alive)
            if note is None:  # its node left while it was asked
                self._lose(seat.node, f"{type(error).__name__}: {how}")
                return True, how
            how = note
            tell(
                logging.WARNING,
                "node %s: its %s agent died (%s); a fresh one runs each shard it had in "
                "flight alone, then the node's other shards",
                seat.node.name,
                seat.role,
                how,
            )
        return False, how

    def _kill(self, seat: Seat) -> None:
        import ray

        if seat.agent is not None:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(seat.agent, no_restart=True)
            seat.node.dead.append(seat.mark)
            seat.agent = seat.ready = None

    def _lose(self, node: Node, why: str) -> None:
        with self.changed:
            self._lose_locked(node, why)

    def _lose_locked(self, node: Node, why: str) -> None:
        """The node left the cluster: leave it out (its agents killed, in case) and wake the
        shards waiting for it, which go elsewhere."""
        if node.lost is not None:
            return
        node.lost = why
        for seat in node.seats.values():
            self._kill(seat)
        log.warning("node %s lost (%s): its shards run on the other nodes", node.name, why)
        self.changed.notify_all()

    def close_stage(self, stage: str) -> None:
        """Every node's agent of a GPU stage gives its devices back and ends: the node's GPUs
        are held only while the stage runs."""
        import ray

        with self.lock:
            seats = [s for n in self.nodes if (s := n.seats.pop(stage, None)) is not None]
        for seat in seats:
            if seat.agent is None or seat.node.lost is not None:
                continue
            try:
                ray.get(seat.agent.close.remote())
            except Exception as e:  # a node lost as the stage ends: nothing to give back
                log.warning("node %s: closing %s: %s", seat.node.name, stage, e)
            with self.lock:
                self._kill(seat)
                seat.node.dead.remove(seat.mark)  # ended, not dead: Ray ends its processes

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
        args = (self.name, self.serve, self.release, shard)
        return self.cluster._call(
            self.stage, self.stage, lambda agent: agent.serve.remote(*args), shard
        )
