"""Prefect wrappers for stage logic: one task run per shard, named, cached, retried on I/O.

The cache key is (stage, source, shard, stage version, data root) and results persist under
the data root, so retrying a failed flow run resolves finished shards from the cache and runs
only the shards that failed. The cache is only ever a shortcut for what the shard's record on
disk says: a unit whose record or outputs are gone runs again (`refresh_cache`), whatever the
cache holds. Stage logic lives in `tasks/`; nothing here decides data.
"""

from __future__ import annotations

import hashlib
import re
import time
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
from prefect.futures import as_completed

from flows.credentials import export_secrets
from flows.names import DISPLAY
from flows.pools import gpu_slot
from tasks.shards import ShardStats, generation, is_done
from tasks.waterfall import Waterfall, dashboard_markdown

# Bump a stage's version when its output changes meaning: cached results of older versions
# are then ignored.
STAGE_VERSIONS = {
    "metadata": 1,
    "filtered": 2,
    "shards": 1,
    "scores": 1,
    "selected": 2,
    "views": 1,
    "tokens": 1,
    "hf": 1,
    "latents": 2,
}
# Stages that read from the network get retries; compute stages fail fast.
IO_STAGES = {"metadata": 2, "shards": 2}
# Stages that hold a slot of the node's GPU pool limit (flows/pools.py) while they work.
GPU_STAGES = {"scores", "latents"}


PROGRESS_EVERY_S = 1.0


class StageFailed(Exception):
    """Some shards of a stage failed; the others finished and are cached."""


def not_retryable() -> tuple[type[Exception], ...]:
    """Failures a retry cannot fix; their messages say what will (the file to get, the folder to
    delete, the setting to change). Prefect does not retry them, and the flow leads with them."""
    from catalog import CatalogError
    from sdtrain.models import ModelLoadError
    from tasks.adapters.base import SourceLayoutError
    from tasks.score import ScoringWeightsError

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

    Score and encode shards hold one slot of the GPU pool's global concurrency limit.
    """
    if stage in GPU_STAGES:
        with gpu_slot():
            stats = run()
    else:
        stats = run()
    logger = get_run_logger()
    verb = "already done" if stats.skipped else f"done in {stats.seconds:.1f}s"
    logger.info(
        "%s %s/%s %s: %d in, %d out, dropped %s",
        DISPLAY[stage],
        source,
        shard,
        verb,
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
) -> tuple[dict[str, dict], dict[str, str]]:
    """Submit one task per shard, publish progress and counts; `inputs`: per shard, what its
    result depends on besides the stage and shard (see `shard_task`).

    Every shard runs even if some fail. Returns (stats of finished shards, error per failed
    shard); the caller decides what the failures block.
    """
    logger = get_run_logger()
    export_secrets()  # HF token for gated sources: env or Secret block, masked in logs
    name = DISPLAY[stage]
    configured = shard_task.with_options(
        retries=IO_STAGES.get(stage, 0),
        retry_delay_seconds=2,
        retry_condition_fn=_retry_unless_permanent,
        result_storage=result_storage(root),
    )
    progress_id = create_progress_artifact(
        0.0, key=f"{source}-{name}-progress", description=f"{name} {source}: shards done"
    )
    futures = {
        configured.with_options(
            task_run_name=f"{name}-{source}-{shard}",
            # A cached "done" stands only while the unit's record and outputs do.
            refresh_cache=not is_done(root, source, stage, shard),
        ).submit(
            stage=stage,
            source=source,
            shard=shard,
            root=str(root),
            run=run,
            inputs=(inputs or {}).get(shard, ""),
        ): shard
        for shard, run in units.items()
    }
    done: dict[str, dict] = {}
    failed: dict[str, str] = {}
    last_update = time.monotonic()
    for future in as_completed(list(futures)):
        shard = futures[future]
        try:
            done[shard] = future.result()
        except Exception as e:  # a shard's failure is reported; the other shards go on
            failed[shard] = failure_message(e)
            logger.error("%s %s/%s failed: %s", name, source, shard, failed[shard])
        finished = len(done) + len(failed)
        # At most one update a second (and the last): one API call per shard would cost more
        # than a trivial shard's work on a stage of thousands.
        if finished == len(futures) or time.monotonic() - last_update >= PROGRESS_EVERY_S:
            update_progress_artifact(progress_id, 100.0 * finished / len(futures))
            last_update = time.monotonic()
    publish_counts(source, name, done)
    return done, failed


# Counts a stage keeps in its stats records' `extra` that are not drops (the sample is kept),
# shown beside the drops: captions over 77 tokens, truncated by tokenize.
COUNTED_EXTRAS = ("truncated",)


def publish_counts(source: str, name: str, done: dict[str, dict]) -> None:
    """A table artifact: samples in / out, drops per reason and counted extras, per shard and
    in total."""
    reasons = sorted({r for s in done.values() for r in s["dropped"]})
    extras = [k for k in COUNTED_EXTRAS if any(k in s.get("extra", {}) for s in done.values())]
    rows = []
    for shard in sorted(done):
        s = done[shard]
        rows.append(
            {
                "shard": shard,
                "in": s["num_in"],
                "out": s["num_out"],
                **{r: s["dropped"].get(r, 0) for r in reasons},
                **{k: s.get("extra", {}).get(k, 0) for k in extras},
            }
        )
    columns = ["in", "out", *reasons, *extras]
    rows.append({"shard": "total", **{c: sum(row[c] for row in rows) for c in columns}})
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
