"""Partitioned global stages in a build: the `.map(fn, calls)` executor that
tasks/curation/*_partitioned.py use, each call one Prefect task run of a `Stage` (flows/stages.py),
placed by the build's executor as a per-shard unit is (this node's pools, or a cluster's agents).

A task's output is a folder named by its inputs (`partition_files.run_task`), so every task
runs each time and a finished one returns its record at once (`reused`): the folders, not
Prefect's cache, say what is done, and a rerun after a failure or a lost node redoes only the
partitions without a folder. When the build takes this path: `use_partitioned`. The metadata
filter runs whole this way (`filter_metadata`); filter-pixels runs its pHash and semantic levels
this way (`select_pixels`), the rest of it as its one-node unit does.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow.parquet as pq

from flows.execution.names import DISPLAY
from flows.execution.stages import StageFailed, publish_counts
from tasks.curation import duck, filter_partitioned, phash_partitioned, selection
from tasks.curation import filter as flt
from tasks.curation import semantic_partitioned as semantic_parts
from tasks.runtime import concurrency
from tasks.runtime.node import Node
from tasks.runtime.shards import ShardStats, current_node, journal

MODE_ENV = "SDPIPE_PARTITIONED"
MODES = ("auto", "always", "never")
STAGE = "partitions"  # the stage key of every partition task run (its cache key's version)
# Tests only: "<step>:<seconds>" holds each task of that step (keys, scatter, nodes...) that
# long before it runs, so that a test can lose a node with partitions in flight. Read on the
# node (the cluster's agents inherit SDPIPE_* settings, `net.node_env`).
TEST_DELAY_ENV = "SDPIPE_TEST_PARTITION_DELAY"


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


def pixels_need_parts(root: Path, source: str, profile) -> bool:
    """Whether filter-pixels' pHash level has more rows than one task holds
    (`SDPIPE_PHASH_TASK_ROWS`), or its semantic level more than one range of its survivor rule
    (`semantic_partitioned.ROWS_PER_RANGE`): the fetched shards' rows, every status (their
    footers' counts, a bound read without a scan). False without either level."""
    limits = {
        "phash": phash_partitioned.rows_per_task(),
        "semantic": semantic_parts.ROWS_PER_RANGE,
    }
    levels = [level for level in limits if level in profile.dedup]
    if not levels:
        return False
    files = sorted((root / source / "shards").glob("[0-9]*.parquet"))
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    return any(rows > limits[level] for level in levels)


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
        folder = self.run.root / self.run.name / STAGE
        for n, call in zip(names, calls, strict=True):
            unit = functools.partial(_on_node, fn, call, folder, f"{self.prefix}-{step}", n)
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


def _on_node(fn, call: tuple, folder: Path, task: str, name: str, node: Node) -> ShardStats:
    """One partition task on `node`: in the node's call pool where its budget runs GIL-bound
    work in processes (the task counts against the budget), else in this thread. Its start,
    end and node go to the `partitions` progress journal (`folder`: the source's partitions)."""
    journal(folder, name, "start", node=current_node(), task=task)
    try:
        _test_delay(fn)
        if concurrency.use_processes(node.workers):
            record = node.in_process(node.workers, fn, *call)
        else:
            record = fn(*call)
    except Exception:
        journal(folder, name, "failed", task=task)
        raise
    record = record | {"node": current_node()}
    rows = int(record.get("rows", 0) or 0)
    journal(folder, name, "done", num_in=rows, seconds=record.get("seconds", 0.0), task=task)
    return ShardStats(
        stage=STAGE,
        source=folder.parent.name,
        shard=name,
        num_in=rows,
        num_out=rows,
        seconds=float(record.get("seconds", 0.0)),
        extra={"record": record},
        skipped=bool(record.get("reused")),
        node=record["node"],
    )


def _test_delay(fn) -> None:
    step, _, seconds = (os.environ.get(TEST_DELAY_ENV) or "").partition(":")
    if step and fn.__name__ == f"{step}_task":
        time.sleep(float(seconds))


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


def select_pixels(run, identity: dict | None, select) -> None:
    """filter-pixels with its pHash and semantic levels as partitioned tasks
    (`PartitionedLosers`, `PartitionedSemantic` on `PartitionTasks`), the rest in this process
    as the one-node unit (`select(phash=..., semantic=...)`, the flow's `select_pixels`) runs
    it; the same selection, record (plus `partitioned`, less the semantic level's
    missed-duplicate estimate) and counts. The partition files go once the selection is
    written: a failed run's stay for the rerun."""
    if run.failures:
        raise StageFailed(
            f"{DISPLAY['selected']} needs every shard before it: " + run.failed_message()
        )
    if selection.selection_done(run.root, run.name, identity):
        return
    workdir = run.root / run.name / "partitions"
    losers = phash_partitioned.PartitionedLosers(
        PartitionTasks(run, DISPLAY["selected"] + "-phash"), workdir
    )
    semantic = semantic_parts.PartitionedSemantic(
        PartitionTasks(run, DISPLAY["selected"] + "-semantic"), workdir
    )
    stats = select(phash=losers, semantic=semantic)
    losers.cleanup()
    semantic.cleanup()
    publish_counts(run.name, DISPLAY["selected"], {flt.ALL: asdict(stats)})
