"""Partitioned global stages in a build: the `.map(fn, calls)` executor that
tasks/curation/*_partitioned.py use, each call one Prefect task run of a `Stage` (flows/stages.py),
placed by the build's executor as a per-shard unit is (this node's pools, or a cluster's agents).

A task's output is a folder named by its inputs (`partition_files.run_task`), so every task
runs each time and a finished one returns its record at once (`reused`): the folders, not
Prefect's cache, say what is done, and a rerun after a failure or a lost node redoes only the
partitions without a folder. When the build takes this path: `use_partitioned`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict
from pathlib import Path

from flows.execution.stages import StageFailed, publish_counts
from tasks.curation import duck, filter_partitioned
from tasks.curation import filter as flt
from tasks.runtime import concurrency
from tasks.runtime.node import Node
from tasks.runtime.shards import ShardStats, current_node

MODE_ENV = "SDPIPE_PARTITIONED"
MODES = ("auto", "always", "never")
STAGE = "partitions"  # the stage key of every partition task run (its cache key's version)


def mode() -> str:
    """`SDPIPE_PARTITIONED`: auto (default), always or never."""
    value = (os.environ.get(MODE_ENV) or "auto").strip().lower()
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def use_partitioned(on_cluster: bool, needs_parts: bool) -> bool:
    """Whether a global stage runs as partitioned tasks: `always`/`never` as set; `auto`: on a
    Ray cluster (its nodes share the work, and a lost node costs only its partitions), and on
    one node when the rows need more than one task's memory (`needs_parts`)."""
    chosen = mode()
    if chosen != "auto":
        return chosen == "always"
    return on_cluster or needs_parts


def filter_needs_parts(root: Path, source: str) -> bool:
    """Whether the metadata filter's rows exceed one task's memory
    (`SDPIPE_FILTER_TASK_MEMORY`): the partitioned plan would have more than one partition."""
    files = sorted((root / source / "metadata").glob("*.parquet"))
    size = duck.input_bytes(files) if files else 0
    return size * filter_partitioned.MEMORY_PER_INPUT_BYTE > filter_partitioned.task_memory()


class PartitionTasks:
    """The partitioned modules' executor inside a build (`run`: its `_Run`): `map` runs every
    call as a task run named `<prefix>-<step>-<source>-<indices>` (filter-scatter-laion-00003)
    on the executor's nodes, at most the stage limit `partitions` at once, and returns the
    records in call order; a failed task fails the map with `StageFailed` naming it, after the
    others finished (their folders stand for the rerun)."""

    def __init__(self, run, prefix: str):
        self.run, self.prefix = run, prefix
        node = getattr(run.nodes, "node", None)
        # DuckDB threads per task follow from this (the node's cores over its tasks at once).
        self.workers = node.workers if node is not None else 1

    def map(self, fn, calls) -> list[dict]:
        if not calls:
            return []
        step = fn.__name__.removesuffix("_task")
        names = [_call_name(call, i) for i, call in enumerate(calls)]
        inputs = {n: f"{step}-{_plan_name(call)}" for n, call in zip(names, calls, strict=True)}
        one = self.run.stage(
            STAGE,
            name=f"{self.prefix}-{step}",
            limit=self.run.limits[STAGE],
            needs_all=True,
            inputs=inputs,
            expected=len(calls),
            done=lambda _: False,  # the task itself finds its folder (and says `reused`)
        )
        for n, call in zip(names, calls, strict=True):
            unit = functools.partial(_on_node, fn, call, self.run.name, n)
            one.add(n, self.run.remote(STAGE, unit, n))
        one.seal()
        self.run.stages.wait()
        if one.failed:
            raise StageFailed(self.run.failed_message())
        return [one.done[n]["extra"]["record"] for n in names]


def _call_name(call: tuple, position: int) -> str:
    """A call's indices (partition, pass, round: its ints after the plan), else its position."""
    ints = [c for c in call[1:] if isinstance(c, int) and not isinstance(c, bool)]
    return "-".join(f"{i:05d}" for i in ints or [position])


def _plan_name(call: tuple) -> str:
    """The plan's folder name: a digest of its inputs and settings."""
    root = getattr(call[0], "root", None) if call else None
    return Path(root).name if root is not None else ""


def _on_node(fn, call: tuple, source: str, name: str, node: Node) -> ShardStats:
    """One partition task on `node`: in the node's call pool where its budget runs GIL-bound
    work in processes (the task counts against the budget), else in this thread."""
    if concurrency.use_processes(node.workers):
        record = node.in_process(node.workers, fn, *call)
    else:
        record = fn(*call)
    record = record | {"node": current_node()}
    rows = int(record.get("rows", 0) or 0)
    return ShardStats(
        stage=STAGE,
        source=source,
        shard=name,
        num_in=rows,
        num_out=rows,
        seconds=float(record.get("seconds", 0.0)),
        extra={"record": record},
        skipped=bool(record.get("reused")),
        node=record["node"],
    )


def filter_metadata(run, profile, samples_per_shard: int) -> None:
    """The metadata filter (URL dedup included) as partitioned tasks, writing what
    `filter.filter_metadata` writes; its record and counts as the one-node stage's."""
    stats = filter_partitioned.filter_metadata(
        run.root,
        run.name,
        profile,
        samples_per_shard,
        executor=PartitionTasks(run, "filter"),
        workdir=run.root / run.name / "partitions",
    )
    publish_counts(run.name, "filter", {flt.ALL: asdict(stats)})
