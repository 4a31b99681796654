"""A build-latents run's agents on a Ray cluster's nodes (flows/execution/cluster.py): the actor,
what a dead one's death says, clearing what a dead one left on its node, and waiting for one to
start.

Every process an agent starts carries its mark in its environment (`MARK`), so the agent that
replaces a dead one kills what the dead one left (pool workers, their children: their GPU
memory and memfd shared memory go with them) before it takes a shard. Waiting has a deadline
(`SDPIPE_CLUSTER_WAIT_S`) and says, every `TELL_EVERY_S`, what it waits for and who holds it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flows.execution import death_notes
from tasks.runtime import node as runtime_node
from tasks.runtime.shards import ShardStats, current_node

log = logging.getLogger(__name__)

CPU = "cpu"  # the role of a node's CPU agent; a GPU stage's agent has the stage's name
MARK = "SDPIPE_AGENT"  # in the environment of an agent and of every process it starts
CLEAR_S = 30.0  # a dead agent's processes must be gone within this long of their SIGKILL
WAIT_S = 600.0  # default of SDPIPE_CLUSTER_WAIT_S: the longest wait for an agent to start
TELL_EVERY_S = 30.0
NOTE_S = 30.0  # the longest wait for a node to tell how its agent died
RAY_OOM = "killed for memory (OOM, as Ray reports it)"  # Ray's memory monitor's kill
POLL_S = 0.5


class ClusterError(Exception):
    """The cluster cannot run the build (no address answers, no node has CPUs, every node was
    lost, an agent waited past the deadline); the message says which and what to do."""


class ShardKilledAgent(Exception):
    """A shard killed every agent that ran it alone (a poison shard): it fails, the run goes
    on with the other shards."""


def wait_limit() -> float:
    value = os.environ.get("SDPIPE_CLUSTER_WAIT_S")
    return float(value) if value else WAIT_S


def tell(level: int, message: str, *args) -> None:
    """To the Prefect run's log (the dashboard) where there is a run, else this module's."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        logger = get_run_logger()
    except MissingContextError:
        logger = log
    logger.log(level, message, *args)


def clear(marks: list[str]) -> int:
    """SIGKILL every process of this machine whose environment carries one of the dead
    agents' `marks`, and wait until they are gone (zombies hold no memory); their number."""
    wanted = [f"{MARK}={m}".encode() for m in marks]
    killed: set[int] = set()
    deadline = time.monotonic() + CLEAR_S
    while True:
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:  # gone, or not ours
                continue
            if any(w in env for w in wanted):
                left.append(int(entry))
        if not left:
            return len(killed)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {left} of a dead agent outlived their SIGKILL")
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.05)


class NodeAgent:
    """One node's worker for one build-latents run (a Ray actor; see flows/execution/cluster.py):
    the node's CPU agent runs CPU units; a GPU stage's agent on the node holds its GPUs and runs
    that stage's `Devices`."""

    def __init__(self, env: dict[str, str], mark: str, dead: list[str]):
        self.cleared = clear(dead) if dead else 0
        death_notes.begin(mark)  # how it dies, for the flow to read on its node after
        os.environ.update(env)  # for the processes it starts: its pools' workers
        os.environ[MARK] = mark
        # The node as this agent sees it: its budget, devices and pools, its slots.
        self.node = runtime_node.local_node(int(env["SDPIPE_WORKERS"]))
        self.devices = None
        self.lock = threading.Lock()

    def ready(self) -> dict:
        return {
            "node": current_node(),
            "pid": os.getpid(),
            "devices": self.node.devices,
            "cleared": self.cleared,
        }

    def run(self, unit: Callable[[runtime_node.Node], ShardStats]) -> ShardStats:
        """One shard's unit of a CPU stage (fetch, repack, tokenize), in this process, on its
        node."""
        return unit(self.node)

    def serve(self, name: str, serve, release, shard: str) -> ShardStats:
        """One shard of this agent's GPU stage through the node's `Devices` for it: one worker
        per device, its model built once, kept for the stage's later shards."""
        from flows.execution.devices import Devices

        with self.lock:
            if self.devices is None:
                node = self.node
                self.devices = Devices(
                    name, functools.partial(serve, node), lanes=len(node.devices), release=release
                )
        return self.devices.run(shard)

    def close(self) -> None:
        """The stage has no more shards: its workers give their devices back."""
        with self.lock:
            devices, self.devices = self.devices, None
        if devices is not None:
            devices.close()


def clear_task(marks: list[str], run: str | None = None) -> int:
    """`clear` as a Ray task on a node (a dead agent nobody replaced, at the run's end); with
    `run`, the death notes of that run's agents there go too."""
    cleared = clear(marks) if marks else 0
    if run is not None:
        death_notes.forget(f"{run}-")
    return cleared


def note_task(mark: str) -> tuple[str | None, str]:
    """`death_notes.read` as a Ray task on the dead agent's node."""
    return death_notes.read(mark)


def on_node(node: Node, fn: Callable):
    """`fn` as a Ray task on `node`, asking for no CPU (it waits for nothing)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(fn).options(
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        runtime_env={"env_vars": node.env},
    )


def death_note(node: Node, mark: str, how: str, alive: Callable[[str], bool]) -> str | None:
    """How the agent `mark` died: what its node tells (a fatal signal's report, OOM kills of
    its cgroup; death_notes), else Ray's words `how`; None where the node left meanwhile
    (`alive(node_id)` no longer). A fatal signal's whole report goes to the run's log."""
    import ray

    try:
        note, report = ray.get(on_node(node, note_task).remote(mark), timeout=NOTE_S)
    except Exception as e:  # the node cannot tell: Ray's words alone, if it is still there
        if not alive(node.node_id):
            return None
        log.info("node %s: no death note of agent %s: %s", node.name, mark, e)
        return how
    if report:
        tell(
            logging.WARNING, "node %s: agent %s's fatal-signal report:\n%s", node.name, mark, report
        )
    if note is None and how != RAY_OOM:  # Ray's memory monitor kills by SIGKILL
        return f"{how}; no fatal signal reported, no OOM kill counted: a SIGKILL, or an exit"
    return note or how


def how_it_died(error: BaseException) -> tuple[bool, str]:
    """(whether Ray says the agent's node died, how the agent died in Ray's words): Ray 2.60
    names an OOM kill and its exit type and detail, not the exit status or signal (os._exit,
    SIGKILL and SIGSEGV all read "connection error code 2. End of file")."""
    text = str(error)
    node_died = "node has died" in text or "NodeDiedError" in text
    if "OUT_OF_MEMORY" in text or "OutOfMemoryError" in text or "low on memory" in text:
        return node_died, RAY_OOM
    if (m := re.search(r"Worker exit type: (\S+) Worker exit detail: ([^.]*)", text)) is not None:
        return node_died, f"its process died ({m[1]}: {m[2]})"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return node_died, lines[-1] if lines else type(error).__name__


def holders(node_id: str, own: set[str]) -> str:
    """What holds a node's resources now, as far as Ray's actor table tells: its free
    resources and the other live actors on it (their names, classes and jobs)."""
    import ray

    try:
        state = ray._private.state.state
        free = state.available_resources_per_node().get(node_id, {})
        total = state.total_resources_per_node().get(node_id, {})
        actors = ray._private.state.state.actor_table(None)
    except Exception as e:  # best effort: the message still says what it waits for
        return f"(Ray's state unreadable: {e})"
    others = sorted(
        f"{a.get('Name') or a.get('ActorClassName')} (job {a.get('JobID')})"
        for aid, a in actors.items()
        if a.get("State") == "ALIVE"
        and a.get("Address", {}).get("NodeID") == node_id
        and aid not in own
    )
    shown = ", ".join(
        f"{k} {free.get(k, 0):g} of {total[k]:g}" for k in ("CPU", "GPU") if k in total
    )
    return (
        f"free there: {shown or 'nothing'}; other actors alive there: {'; '.join(others) or 'none'}"
    )


def wait_ready(
    ref: Any, what: str, node_id: str, alive: Callable[[], bool], own: Callable[[], set[str]]
) -> dict:
    """ray.get(ref) of an agent's `ready`, saying every TELL_EVERY_S what it waits for (and
    who holds the node's resources), failing past `wait_limit()`; raises `NodeGone` as soon as
    the node is no longer alive."""
    import ray

    started = time.monotonic()
    told = started
    limit = wait_limit()
    while True:
        done, _ = ray.wait([ref], timeout=POLL_S)
        if done:
            return ray.get(ref)
        now = time.monotonic()
        if not alive():
            raise NodeGone(f"its node left the cluster while {what} started")
        if now - started > limit:
            raise ClusterError(
                f"waited {now - started:.0f} s for {what} (SDPIPE_CLUSTER_WAIT_S={limit:g}), "
                f"{holders(node_id, own())}: free the node or raise the limit"
            )
        if now - told >= TELL_EVERY_S:
            told = now
            tell(
                logging.WARNING,
                "waiting %.0f s for %s (limit %g s): %s",
                now - started,
                what,
                limit,
                holders(node_id, own()),
            )


class NodeGone(Exception):
    """The node left the cluster (Ray no longer lists it alive)."""


@dataclass
class Seat:
    """One agent's place on a node: the node's CPU agent, or a GPU stage's agent there."""

    node: Node
    role: str  # CPU, or the GPU stage's name
    agent: Any = None  # its actor, None while there is none (not started yet, or it died)
    mark: str = ""  # the agent's mark (cluster_agents.MARK)
    ready: Any = None  # the agent's `ready` call, waited on before a shard goes to it
    dead: list[str] = field(default_factory=list)  # marks of dead agents not cleared yet
    suspects: int = 0  # shards that were in flight when an agent here died, to run alone
    solo: bool = False  # its agent runs one suspect shard, alone
    busy: int = 0  # shards on its agent now
    used: bool = False  # a shard ran on its agent: not a fresh one for a suspect


@dataclass
class Node:
    """A node of the cluster as the flow sees it."""

    name: str
    node_id: str
    index: int
    budget: int  # its worker budget (SDPIPE_WORKERS there)
    gpus: int
    env: dict[str, str]
    lost: str | None = None  # why it was left out
    running: Counter = field(default_factory=Counter)  # per stage, shards it works on now
    seats: dict[str, Seat] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)  # marks of its dead agents, not cleared yet

    @property
    def devices(self) -> int:  # GPU lanes (GPUs; 1 on a node without: `cpu:0`)
        return max(1, self.gpus)


def names(nodes: list[dict]) -> list[str]:
    """Each node's name: its host name, with its Ray node id's start where several nodes share
    a host (several raylets on one machine)."""
    hosts = Counter(n["NodeManagerHostname"] for n in nodes)
    return [
        n["NodeManagerHostname"]
        if hosts[n["NodeManagerHostname"]] == 1
        else f"{n['NodeManagerHostname']}-{n['NodeID'][:6]}"
        for n in nodes
    ]


def who() -> str:
    """This run in the agents' actor names, so another run waiting for a node says who holds
    it: the Prefect flow run's name, else this process."""
    with contextlib.suppress(Exception):
        from prefect.runtime import flow_run

        if flow_run.name:
            return f"{flow_run.flow_name}/{flow_run.name}"
    return f"{os.uname().nodename}-pid{os.getpid()}"


def usable(n: dict) -> bool:
    return n["Alive"] and n["Resources"].get("CPU", 0) >= 1
