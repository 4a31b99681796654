"""Prefect wrappers for stage logic: one task run per shard, named, cached, retried on I/O.

A stage runs at most `limit` shard task runs at once (its own bound, not the flow's thread
pool: stages of one flow run overlap, each with the concurrency its work wants), and a stage
can take shards while it runs, so the next stage of a chain starts on a shard as soon as the
one before has finished it (`StageRun`).

The cache key is (stage, source, shard, stage version, data root) and results persist under
the data root, so retrying a failed flow run resolves finished shards from the cache and runs
only the shards that failed. The cache is only ever a shortcut for what the shard's record on
disk says: a unit whose record or outputs are gone runs again (`refresh_cache`), whatever the
cache holds. Stage logic lives in `tasks/`; nothing here decides data.
"""

from __future__ import annotations

import hashlib
import queue
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.filesystems import LocalFileSystem
from prefect.futures import PrefectFuture

from flows.execution.credentials import export_secrets
from flows.execution.names import DISPLAY
from tasks.curation.waterfall import Waterfall, dashboard_markdown
from tasks.runtime.shards import ShardStats, generation, is_done

# Bump a stage's version when its output changes meaning: cached results of older versions
# are then ignored.
STAGE_VERSIONS = {
    "metadata": 1,
    "filtered": 2,
    "prefetch": 1,
    "shards": 1,
    "scores": 1,
    "selected": 2,
    "views": 1,
    "tokens": 1,
    "hf": 1,
    "latents": 2,
    "partitions": 1,  # a partitioned global stage's tasks (flows/execution/partitioned.py)
}
# Stages that read from the network get retries; compute stages fail fast.
IO_STAGES = {"metadata": 2, "shards": 2}


PROGRESS_EVERY_S = 1.0


class StageFailed(Exception):
    """Some shards of a stage failed; the others finished and are cached."""


def not_retryable() -> tuple[type[Exception], ...]:
    """Failures a retry cannot fix; their messages say what will (the file to get, the folder to
    delete, the setting to change). Prefect does not retry them, and the flow leads with them."""
    from catalog import CatalogError
    from sdtrain.models import ModelLoadError
    from tasks.curation.score import ScoringWeightsError
    from tasks.sources.adapters.base import SourceLayoutError

    return (CatalogError, ModelLoadError, ScoringWeightsError, SourceLayoutError)


def _retry_unless_permanent(task, task_run, state) -> bool:
    try:
        state.result()
    except not_retryable():
        return False
    except Exception:
        return True
    return True


def failure_message(error: BaseException) -> str:
    """One line for a failed unit: the error itself where a retry cannot fix it."""
    if isinstance(error, not_retryable()):
        return f"cannot succeed on a retry: {error}"
    return f"{type(error).__name__}: {error}"


def _root_id(root: str) -> str:
    return hashlib.sha1(root.encode()).hexdigest()[:10]


def result_storage(root: Path) -> LocalFileSystem:
    """A storage block for task results under the data root, saved on the server once.

    Results live beside the data they describe: deleting the data root also forgets the
    cache, so a cached "done" can never point at outputs that are gone. The saved block
    itself (not its name) goes to the tasks: a name would be loaded from the server again by
    every task run (bench/orchestration.py measured that on the critical path).
    """
    name = f"sdpipe-results-{_root_id(str(root))}"
    block = LocalFileSystem(basepath=str(root / ".prefect" / "results"))
    block.save(name, overwrite=True)
    return block


def _cache_key(context, parameters: dict) -> str:
    root_id = _root_id(parameters["root"])
    stage, source = parameters["stage"], parameters["source"]
    # The source's generation changes when finished shards are changed in place (a refetch):
    # then every task runs again, and the stage records decide what is really redone.
    gen = generation(Path(parameters["root"]), source)
    key = f"{stage}-{source}-{parameters['shard']}-v{STAGE_VERSIONS[stage]}-g{gen}-{root_id}"
    inputs = parameters.get("inputs")
    return f"{key}-i{inputs}" if inputs else key


@task(persist_result=True, cache_key_fn=_cache_key)
def shard_task(
    stage: str,
    source: str,
    shard: str,
    root: str,
    run: Callable[[], ShardStats],
    inputs: str = "",
) -> dict:
    """Run one shard of one stage; returns its stats record as a dict.

    `inputs`: a digest of what the unit depends on besides its stage and shard (a view's
    profile and selection), so a change to them is a cache miss, not a cached "done".

    Score and encode shards hand their work to a device worker (flows/execution/devices.py), which
    holds a slot of the GPU pool and its device while it works.
    """
    stats = run()
    logger = get_run_logger()
    verb = "already done" if stats.skipped else f"done in {stats.seconds:.1f}s"
    logger.info(
        "%s %s/%s %s on %s: %d in, %d out, dropped %s",
        DISPLAY.get(stage, stage),
        source,
        shard,
        verb,
        stats.node or "?",
        stats.num_in,
        stats.num_out,
        stats.dropped or "nothing",
    )
    return asdict(stats)


def run_stage(
    root: Path,
    source: str,
    stage: str,
    units: dict[str, Callable[[], ShardStats]],
    inputs: dict[str, str] | None = None,
    *,
    limit: int | None = None,
) -> tuple[dict[str, dict], dict[str, str]]:
    """Submit one task per shard (at most `limit` at once; default all), publish progress and
    counts; `inputs`: per shard, what its result depends on besides the stage and shard (see
    `shard_task`).

    Every shard runs even if some fail. Returns (stats of finished shards, error per failed
    shard); the caller decides what the failures block.
    """
    run = StageRun(root, source)
    one = run.stage(stage, limit=limit, inputs=inputs, expected=len(units))
    for shard, unit in units.items():
        one.add(shard, unit)
    one.seal()
    run.wait()
    return one.done, one.failed


class StageRun:
    """The stages of one flow run that run at once, each shard task run submitted from the
    flow's thread as a shard becomes ready, completions handled in the order they come."""

    def __init__(self, root: Path, source: str):
        export_secrets()  # HF token for gated sources: env or Secret block, masked in logs
        self.root, self.source = root, source
        self.storage = result_storage(root)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.stages: list[Stage] = []

    def stage(
        self,
        stage: str,
        *,
        limit: int | None = None,
        inputs: dict[str, str] | None = None,
        expected: int = 0,
        done: Callable[[str], bool] | None = None,
        name: str | None = None,
    ) -> Stage:
        """A stage of this run: `limit` task runs at once (None: no bound of its own);
        `expected`: the units it will get at most, for its progress; `done(shard)`: whether a
        unit is done on disk (default: its record and outputs, `tasks.runtime.shards.is_done`);
        `name`: its task runs' and artifacts' name (default the stage's, `DISPLAY`)."""
        one = Stage(
            self, stage, limit=limit, inputs=inputs, expected=expected, done=done, name=name
        )
        self.stages.append(one)
        return one

    def wait(self) -> None:
        """Until every stage is sealed and its task runs finished (callbacks may add units to
        later stages and seal them)."""
        while not all(s.finished for s in self.stages):
            if not any(s.running for s in self.stages):
                unsealed = [s.name for s in self.stages if not s.sealed]
                raise RuntimeError(f"stages {unsealed} wait for units nothing will add")
            stage, future = self.events.get()
            stage.completed(future)


class Stage:
    """One stage of a `StageRun`: `add` units (while it runs), `seal` when no more will come.

    Callbacks run on the flow's thread (they may add units to a later stage): `on_done(fn)`,
    fn(shard, stats) for each unit that finished; `on_end(fn)`, fn(stage) once it is sealed and
    every unit has finished or failed. `limit`: units at once, or a function giving it at each
    fill (a cluster's, which grows as nodes join).
    """

    def __init__(
        self, run: StageRun, stage: str, *, limit, inputs, expected: int, done=None, name=None
    ):
        self.run, self.stage, self.name = run, stage, name or DISPLAY[stage]
        self.limit = limit
        self.inputs = inputs or {}
        self.done_on_disk = done or (lambda shard: is_done(run.root, run.source, stage, shard))
        self.expected = expected
        self.configured = shard_task.with_options(
            retries=IO_STAGES.get(stage, 0),
            retry_delay_seconds=2,
            retry_condition_fn=_retry_unless_permanent,
            result_storage=run.storage,
        )
        self.progress_id = create_progress_artifact(
            0.0,
            key=f"{run.source}-{self.name}-progress",
            description=f"{self.name} {run.source}: shards done",
        )
        self.waiting: deque[tuple[str, Callable[[], ShardStats]]] = deque()
        self.running: dict[PrefectFuture, str] = {}
        self.done: dict[str, dict] = {}
        self.failed: dict[str, str] = {}
        self.added = 0
        self.sealed = self.ended = False
        self.then: list[Callable[[str, dict], None]] = []
        self.at_end: list[Callable[[Stage], None]] = []
        self.started: float | None = None
        self.last_update = time.monotonic()

    @property
    def finished(self) -> bool:
        return self.sealed and not self.waiting and not self.running

    def on_done(self, fn: Callable[[str, dict], None]) -> None:
        self.then.append(fn)

    def on_end(self, fn: Callable[[Stage], None]) -> None:
        self.at_end.append(fn)

    def add(self, shard: str, run: Callable[[], ShardStats]) -> None:
        self.waiting.append((shard, run))
        self.added += 1
        self._fill()

    def seal(self) -> None:
        self.sealed = True
        self._maybe_end()

    def _fill(self) -> None:
        limit = self.limit() if callable(self.limit) else self.limit
        while self.waiting and (limit is None or len(self.running) < limit):
            shard, run = self.waiting.popleft()
            root = self.run.root
            future = self.configured.with_options(
                task_run_name=f"{self.name}-{self.run.source}-{shard}",
                # A cached "done" stands only while the unit's record and outputs do.
                refresh_cache=not self.done_on_disk(shard),
            ).submit(
                stage=self.stage,
                source=self.run.source,
                shard=shard,
                root=str(root),
                run=run,
                inputs=self.inputs.get(shard, ""),
            )
            self.started = self.started or time.monotonic()
            self.running[future] = shard
            future.add_done_callback(lambda f, events=self.run.events: events.put((self, f)))

    def completed(self, future: PrefectFuture) -> None:
        shard = self.running.pop(future)
        ok = False
        try:
            self.done[shard] = future.result()
            ok = True
        except Exception as e:  # a shard's failure is reported; the other shards go on
            self.failed[shard] = failure_message(e)
            get_run_logger().error(
                "%s %s/%s failed: %s", self.name, self.run.source, shard, self.failed[shard]
            )
        self._fill()
        finished = len(self.done) + len(self.failed)
        total = max(self.expected, self.added, 1)
        # At most one update a second (and the last, at the end): one API call per shard would
        # cost more than a trivial shard's work on a stage of thousands.
        if not self.finished and time.monotonic() - self.last_update >= PROGRESS_EVERY_S:
            update_progress_artifact(self.progress_id, 100.0 * finished / total)
            self.last_update = time.monotonic()
        if ok:
            for fn in self.then:
                fn(shard, self.done[shard])
        self._maybe_end()

    def _maybe_end(self) -> None:
        if not self.finished or self.ended:
            return
        self.ended = True
        if self.started is not None:
            get_run_logger().info(
                "%s %s: %d shard(s) done, %d failed, %.1f s from its first shard to its last",
                self.name,
                self.run.source,
                len(self.done),
                len(self.failed),
                time.monotonic() - self.started,
            )
        if self.added:
            update_progress_artifact(
                self.progress_id, 100.0 * (len(self.done) + len(self.failed)) / self.added
            )
        publish_counts(self.run.source, self.name, self.done)
        for fn in self.at_end:
            fn(self)


# Counts a stage keeps in its stats records' `extra` that are not drops (the sample is kept),
# shown beside the drops: captions over 77 tokens, truncated by tokenize.
COUNTED_EXTRAS = ("truncated",)


def publish_counts(source: str, name: str, done: dict[str, dict]) -> None:
    """A table artifact: samples in / out, drops per reason and counted extras, per shard and
    in total, and the node that did each shard."""
    reasons = sorted({r for s in done.values() for r in s["dropped"]})
    extras = [k for k in COUNTED_EXTRAS if any(k in s.get("extra", {}) for s in done.values())]
    rows = []
    for shard in sorted(done):
        s = done[shard]
        rows.append(
            {
                "shard": shard,
                "node": s.get("node", ""),
                "in": s["num_in"],
                "out": s["num_out"],
                **{r: s["dropped"].get(r, 0) for r in reasons},
                **{k: s.get("extra", {}).get(k, 0) for k in extras},
            }
        )
    columns = ["in", "out", *reasons, *extras]
    nodes = len({row["node"] for row in rows})
    rows.append(
        {
            "shard": "total",
            "node": f"{nodes} node{'s' * (nodes != 1)}",
            **{c: sum(row[c] for row in rows) for c in columns},
        }
    )
    create_table_artifact(
        rows,
        key=f"{source}-{name}-counts",
        description=f"{name} {source}: samples in, out and dropped by reason",
    )


def artifact_key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def publish_waterfall(source: str, report: Path, gallery: Path) -> None:
    """The filter waterfall as a table artifact, and its gallery (thumbnails embedded) as a
    markdown artifact."""
    if not report.exists():  # the stage failed before writing it; its failure is reported
        return
    wf = Waterfall.read(report)
    what = f"{wf.stage} {source} (profile {wf.profile})"
    create_table_artifact(
        wf.table(),
        key=artifact_key(source, wf.stage, "waterfall"),
        description=f"{what}: rows removed per rule, alone and in sequence",
    )
    create_markdown_artifact(
        dashboard_markdown(wf, gallery),
        key=artifact_key(source, wf.stage, "gallery"),
        description=f"{what}: rejected samples per rule",
    )
