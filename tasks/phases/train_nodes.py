"""Launch one training on N nodes of a Ray cluster: torchrun on each, joined by c10d rendezvous.

Ray only places and watches; it does not train. A placement group reserves N distinct nodes
(STRICT_SPREAD), and a small actor on each runs the torchrun command `launch_training` runs on
one node, with `--nnodes N` and a rendezvous hosted by the first. The trainer keeps its own
checkpoint, resume and SIGTERM-stop logic (Ray Train would mean another loop): a cancel is a
SIGTERM to every node's torchrun, as on one node. Every node must see the same data root (the
run folder) and the same checkout at the same path.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sdtrain.config import TrainConfig
from tasks.phases.train import STOP_MARGIN_S, TrainingFailed, node_line
from tasks.runtime.net import PROJECT_ROOT, node_env, python_path
from tasks.runtime.ray_connect import connection

POLL_S = 0.5  # between two reads of the nodes' new lines
READ_TIMEOUT_S = 10.0  # one read of a node's lines
ANSWER_S = 60.0  # a node whose actor has not answered in this long, while running, is lost
RESERVE_TIMEOUT_S = 600.0  # waiting for N free nodes before giving up


class NodeTrainer:
    """A Ray actor on one node of the placement group: its torchrun, its output, its stop."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []  # torchrun's lines not yet read by the launcher
        self.first = 0  # the number of the first of them (the ones before were read)
        self.returncode: int | None = None

    def where(self) -> dict:
        """This node's address (the ranks' and the rendezvous'), Ray node id and host name."""
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
        }

    def free_port(self) -> int:
        """A TCP port nothing on this node listens on right now (for the rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, torchrun_args: list[str], env: dict[str, str]) -> int:
        """Start torchrun here with these arguments; its pid."""
        # When this actor's worker exits, Ray kills its child processes: torchrun. Its ranks
        # then fail on their peers' broken collectives; nothing trains without a launcher.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *torchrun_args],
            cwd=PROJECT_ROOT, env={**os.environ, **env}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
        self.returncode = self.proc.wait()  # after the last line, so a reader sees them all

    def read(self, offset: int) -> tuple[list[str], int | None]:
        """The lines after the first `offset`, and torchrun's exit code once it has ended.
        Lines before `offset` were read: they are dropped (weeks of a run's output are not
        kept in this actor)."""
        returncode = self.returncode  # first: once set, every line is in
        if offset > self.first:
            del self.lines[: offset - self.first]
            self.first = offset
        return self.lines[offset - self.first :], returncode

    def stop(self) -> None:
        """SIGTERM to torchrun, which passes it to the ranks: they checkpoint and stop."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


class _Nodes:
    """The launcher's view of the actors: each node's place, lines read, exit code, or loss."""

    def __init__(self, actors: list, places: list[dict], on_line: Callable[[str], None]):
        self.actors, self.places, self.on_line = actors, places, on_line
        self.offsets = [0] * len(actors)
        self.codes: list[int | None] = [None] * len(actors)
        self.silent_since: dict[int, float] = {}  # node -> when its actor stopped answering
        self.lost: dict[int, str] = {}  # node -> why it counts as lost
        self.tail: collections.deque[str] = collections.deque(maxlen=20)

    def label(self, i: int) -> str:
        p = self.places[i]
        return f"{p['ip']} (host {p['host']}, Ray node {p['node_id']})"

    def running(self) -> list[int]:
        return [i for i, c in enumerate(self.codes) if c is None and i not in self.lost]

    def failed(self) -> bool:
        return bool(self.lost) or any(self.codes)

    def read(self, *, forward: bool = True) -> bool:
        """Read every running node's new lines (to `on_line` if `forward`); True if any. A node
        is lost when its actor died, or has not answered for ANSWER_S (a network blip is not)."""
        refs = {i: self.actors[i].read.remote(self.offsets[i]) for i in self.running()}
        news = False
        for i, ref in refs.items():
            try:
                lines, code = ray.get(ref, timeout=READ_TIMEOUT_S)
            except ActorDiedError:
                self.lost[i] = "its Ray actor died with its node"
                continue
            except (ActorUnavailableError, GetTimeoutError) as e:
                since = self.silent_since.setdefault(i, time.monotonic())
                if time.monotonic() - since >= ANSWER_S:
                    self.lost[i] = f"its Ray actor has not answered for {ANSWER_S:.0f} s ({e})"
                continue
            self.silent_since.pop(i, None)
            self.offsets[i] += len(lines)
            self.codes[i] = code
            for line in lines:
                line = node_line(i, self.places[i]["ip"], line)
                self.tail.append(line)
                if forward:
                    self.on_line(line)
            news = news or bool(lines)
        return news

    def stop(self, *, timeout_s: float) -> None:
        """SIGTERM every running node's torchrun and wait for them to end (or `timeout_s`)."""
        for i in self.running():
            self.actors[i].stop.remote()
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            if not self.read(forward=False):
                time.sleep(POLL_S)

    def check_answering(self) -> None:
        """After a failure: every node whose actor does not answer now counts as lost (the
        others' failure is then most likely theirs on its missing ranks)."""
        refs = {i: a.where.remote() for i, a in enumerate(self.actors) if i not in self.lost}
        for i, ref in refs.items():
            try:
                ray.get(ref, timeout=READ_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as e:
                self.lost[i] = f"its Ray actor does not answer ({type(e).__name__})"


def launch_training_on_nodes(
    config: TrainConfig,
    *,
    nodes: int,
    cluster: str = "",
    nproc_per_node: int | None = None,
    on_line: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    reserve_timeout_s: float = RESERVE_TIMEOUT_S,
) -> dict:
    """Run `sdtrain.train` on `nodes` nodes of the Ray cluster at `cluster` (or RAY_ADDRESS, or
    the one this process is connected to) and wait; `nproc_per_node` ranks on each (default:
    the GPUs of the nodes, or 1 CPU rank). Lines come to `on_line` prefixed with the node."""
    run_dir = Path(config.run_dir)
    config_path = run_dir / "config.json"
    config.to_json(config_path)
    with connected(cluster, nodes), reserved(nodes, reserve_timeout_s) as (group, gpus):
        actors = [
            ray.remote(NodeTrainer)
            .options(
                num_cpus=1,
                num_gpus=gpus,
                max_restarts=0,
                runtime_env={"env_vars": {"PYTHONPATH": python_path()}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=i
                ),
            )
            .remote()
            for i in range(nodes)
        ]
        try:
            try:
                watched = start(
                    actors, config, config_path, nproc_per_node or gpus or 1, env, on_line
                )
            except RayActorError as e:
                raise TrainingFailed(f"a node was lost while the training started: {e}") from e
            return watch(watched, config)
        finally:
            for a in actors:
                ray.kill(a)


@contextlib.contextmanager
def connected(cluster: str, nodes: int) -> Iterator[None]:
    """Connected to the Ray cluster at `cluster`, else RAY_ADDRESS, else the one this process
    is connected to (`ray_connect.connect`: another one open, or its token missing, fails);
    disconnected after, if connected here."""
    address = cluster or os.environ.get("RAY_ADDRESS") or None
    if address is None and not ray.is_initialized():
        raise TrainingFailed(
            f"training on {nodes} nodes needs a Ray cluster: give its address (the `cluster` "
            "parameter, e.g. HEAD:6379) or set RAY_ADDRESS"
        )
    with connection(
        address, error=TrainingFailed, log_to_driver=False, logging_level=logging.WARNING
    ):
        yield


def gpus_per_node(nodes: int) -> int:
    """The GPUs each of `nodes` nodes of the cluster can give (0: a CPU cluster). Raises
    TrainingFailed where the cluster has fewer live nodes, or where it has GPUs but fewer
    nodes with them (a CPU head would take a node's place: the ranks would run on CPUs)."""
    counts = sorted(
        (int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]), reverse=True
    )
    if len(counts) < nodes:
        raise TrainingFailed(f"the Ray cluster has {len(counts)} live nodes, not {nodes}")
    if counts[0] and not counts[nodes - 1]:
        with_gpus = sum(1 for c in counts if c)
        raise TrainingFailed(
            f"the Ray cluster has {with_gpus} nodes with GPUs, not {nodes}: a node without "
            "GPUs (its head?) cannot take a GPU node's ranks; add GPU nodes or ask for fewer"
        )
    return counts[nodes - 1]


@contextlib.contextmanager
def reserved(nodes: int, timeout_s: float) -> Iterator[tuple[PlacementGroup, int]]:
    """(placement group, GPUs of each bundle): `nodes` distinct nodes, each with a CPU and its
    GPUs held for the run."""
    gpus = gpus_per_node(nodes)
    bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle] * nodes, strategy="STRICT_SPREAD")
    try:
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except GetTimeoutError:
            raise TrainingFailed(
                f"the Ray cluster did not give {nodes} nodes with {bundle} free each in "
                f"{timeout_s:.0f} s; it has {ray.cluster_resources()}"
            ) from None
        yield group, gpus
    finally:
        remove_placement_group(group)


def start(
    actors: list,
    config: TrainConfig,
    config_path: Path,
    ranks: int,
    env: dict | None,
    on_line: Callable[[str], None],
) -> _Nodes:
    """torchrun on every node, joined by a c10d rendezvous the first node hosts."""
    places = ray.get([a.where.remote() for a in actors])  # the actors' start: their own time
    rendezvous = f"{places[0]['ip']}:{ray.get(actors[0].free_port.remote())}"
    run_id = f"{Path(config.run_dir).name}-{uuid.uuid4().hex[:8]}"
    # What the ranks need from the launching process besides the node's own environment: the
    # data root and catalog, the weights, the model cache, secrets (`node_env`), and `env`
    # (the flows add the Prefect API of their profile). One thread per rank: torch would
    # otherwise start a full pool in every rank.
    rank_env = {**node_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    nodes = _Nodes(actors, places, on_line)
    # The first node hosts the rendezvous store, said outright: torchrun's guess from the
    # address fails where nodes share one (containers on one host, the tests' local cluster).
    for i, (actor, place) in enumerate(zip(actors, places, strict=True)):
        args = [
            "--nnodes", str(len(actors)), "--nproc-per-node", str(ranks),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous, "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={str(i == 0).lower()}", "--local-addr", place["ip"],
            "--max-restarts", "0", "--shutdown-timeout", str(config.stop_grace_s),
            "-m", "sdtrain.train", "--config", str(config_path),
        ]  # fmt: skip
        pid = ray.get(actor.start.remote(args, rank_env))
        where = f"torchrun (pid {pid}) on {nodes.label(i)}: {ranks} ranks, rendezvous {rendezvous}"
        on_line(node_line(i, place["ip"], where))
    return nodes


def watch(nodes: _Nodes, config: TrainConfig) -> dict:
    """Forward the nodes' lines until every torchrun has ended; the summary, or TrainingFailed."""
    grace = config.stop_grace_s + STOP_MARGIN_S
    try:
        while nodes.running() and not nodes.failed():
            if not nodes.read():
                time.sleep(POLL_S)
    except BaseException:
        # Cancelled or interrupted: every node's ranks checkpoint at the next step and exit.
        nodes.stop(timeout_s=grace)
        raise
    if nodes.failed():
        nodes.stop(timeout_s=grace)  # the others fail or hang on the lost ranks: end them
        nodes.check_answering()
        raise TrainingFailed(_failure(nodes, Path(config.run_dir)))
    return json.loads((Path(config.run_dir) / "summary.json").read_text())


def _failure(nodes: _Nodes, run_dir: Path) -> str:
    latest = run_dir / "checkpoints" / "latest"
    resume = (
        f"a rerun resumes from the last checkpoint ({os.readlink(latest)})"
        if latest.is_symlink()
        else "a rerun starts over (no checkpoint yet)"
    )
    if nodes.lost:
        lost = "; ".join(f"node {i} {nodes.label(i)}: {why}" for i, why in nodes.lost.items())
        return f"lost {len(nodes.lost)} of {len(nodes.actors)} nodes: {lost}; {resume}"
    failed = ", ".join(
        f"node {i} {nodes.label(i)} exited with {c}" for i, c in enumerate(nodes.codes) if c
    )
    return f"torchrun failed: {failed}; {resume}: " + "\n".join(nodes.tail)
