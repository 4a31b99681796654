"""eval: tasks/evaluation/evaluate.py as a flow, run by curriculum after each phase's training and
on demand (`eval/phase-N`, `sdpipe eval --phase N`). It holds GPU-pool devices for all its work, so
it never shares a GPU with score, encode or a training. Artifacts: `<phase>-eval-table` (category x
metric, changes green/red), `<phase>-eval-grid` (one image per prompt per category, nearest training
images), `<phase>-eval-progress`.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from catalog import CatalogError, load_catalog
from flows.execution import pools
from flows.execution.stages import PROGRESS_EVERY_S
from sdtrain.weights import WeightsNotFound
from tasks.curation.score import ScoringWeightsError
from tasks.evaluation import eval_report, evaluate, fid
from tasks.generation import generate as gen
from tasks.runtime import shards

USER_ERRORS = (
    CatalogError,
    evaluate.EvalError,
    fid.FIDWeightsError,
    ScoringWeightsError,
    WeightsNotFound,
    gen.GenerateError,
    gen.GenerateFailed,
)


def artifact_key(phase: str, what: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", f"{phase}-eval-{what}".lower())


def check_networks(catalog, phase: str) -> None:
    """Fail naming the eval's missing weights files, if the phase is evaluated."""
    if not catalog.phase(phase).eval_set:
        return
    try:
        evaluate.check_weights(catalog, evaluate.eval_set_of(catalog, phase))
    except (fid.FIDWeightsError, ScoringWeightsError) as e:
        raise type(e)(
            f"{e}. {phase} is evaluated after its training (eval_set in phases.yaml; "
            'eval_set: "" trains it without)'
        ) from None


def preflight(phase: str, root: Path) -> str:
    """The phase's name, once its eval set, final weights and eval networks are there."""
    catalog = load_catalog()
    name = catalog.phase(phase).name
    evaluate.check_weights(catalog, evaluate.eval_set_of(catalog, name))
    evaluate.final_weights(root, name)
    return name


@task(name="eval", task_run_name="eval-{phase}", cache_policy=NO_CACHE)  # the files are the cache
def eval_task(
    root: Path,
    phase: str,
    *,
    reference_dir: str | None = None,
    checkpoints: bool = False,
    num_devices: int | None = None,
) -> dict:
    """Evaluate the phase's final weights (and with `checkpoints`, every kept checkpoint, then
    link the best by the eval set's `select_by`); publish the artifacts."""
    logger = get_run_logger()
    progress_id = create_progress_artifact(
        0.0, key=artifact_key(phase, "progress"), description=f"eval {phase}: images made"
    )
    last_update = 0.0

    def on_progress(done: int, total: int) -> None:
        nonlocal last_update
        if done == total or time.monotonic() - last_update >= PROGRESS_EVERY_S:
            update_progress_artifact(progress_id, 100.0 * done / total)
            last_update = time.monotonic()

    wanted = num_devices or len(pools.node_devices())
    logger.info("waiting for %d device(s) of the GPU pool %r", wanted, pools.gpu_limit_name())
    with pools.gpu_devices(wanted) as devices:
        logger.info("evaluating %s on %s", phase, ", ".join(map(str, devices)))
        kwargs = dict(devices=devices, reference_dir=reference_dir, log=logger.info)
        if checkpoints:
            summary, choice = _choose(root, phase, kwargs, on_progress, logger)
        else:
            summary = evaluate.evaluate(root, phase, on_progress=on_progress, **kwargs)
            choice = None
    publish(root, summary, choice)
    logger.info(eval_report.format_table(summary, _previous(root, summary)))
    return summary


def _choose(root: Path, phase: str, kwargs: dict, on_progress, logger) -> tuple[dict, dict]:
    """Evaluate final/ and every candidate checkpoint together (one memorisation scan of the
    training rows for all), link the best; (final's summary, the choice)."""
    found = evaluate.candidates(root, phase)
    targets = [
        (None, None)
        if name == "final"
        else (folder, evaluate.eval_dir(root, phase) / "checkpoints" / name)
        for name, folder, _ in found
    ]
    summaries = evaluate.evaluate_many(root, phase, targets, on_progress=on_progress, **kwargs)
    metric = load_catalog().eval_set(summaries[0]["eval_set"]).select_by
    results = []
    for (name, folder, step), summary in zip(found, summaries, strict=True):
        value = summary["metrics"]["all"].get(metric)
        results.append({"name": name, "step": step, "weights": str(folder), "value": value})
        logger.info("%s: %s = %s", name, metric, value)
    choice = evaluate.choose_checkpoint(root, phase, metric, results)
    logger.info("best by %s: %s", metric, choice["chosen"]["name"])
    return summaries[0], choice


def _previous(root: Path, summary: dict) -> dict | None:
    return eval_report.read_summary(root, summary["previous"]) if summary["previous"] else None


def publish(root: Path, summary: dict, choice: dict | None = None) -> None:
    """The table and grid artifacts and the TensorBoard scalars of an eval."""
    phase, previous = summary["phase"], _previous(root, summary)
    against = f"changes against {previous['phase']}" if previous else "no previous phase eval"
    create_table_artifact(
        eval_report.table_rows(summary, previous),
        key=artifact_key(phase, "table"),
        description=f"eval {phase} ({summary['eval_set']}): category x metric; {against} "
        "(green better, red worse; val_loss against the starting weights on the same rows)",
    )
    grid = eval_report.grid_markdown(root, summary)
    if choice is not None:
        grid += eval_report.choice_markdown(choice)
    create_markdown_artifact(
        grid,
        key=artifact_key(phase, "grid"),
        description=f"eval {phase}: one image per prompt per category; nearest training images",
    )
    eval_report.write_tensorboard(root, summary)


@flow(name="eval", log_prints=True)
def evaluate_phase(
    phase: str = "demo",
    data_root: str | None = None,
    reference_dir: str | None = None,
    checkpoints: bool = False,
    num_devices: int | None = None,
):
    """Evaluate a trained phase on its eval set (catalog/eval.yaml) into runs/<phase>/eval/.

    `reference_dir`: also the FID against this folder of images (e.g. COCO val 2017), whose
    Inception statistics are cached under the data root. `checkpoints`: also every kept
    checkpoint, and link the best by the eval set's `select_by` as checkpoints/best-by-<metric>.
    A rerun makes only the images its folder lacks.
    """
    logger = get_run_logger()
    root = shards.data_root(data_root)
    try:
        name = preflight(phase, root)
        return eval_task(
            root,
            name,
            reference_dir=reference_dir,
            checkpoints=checkpoints,
            num_devices=num_devices,
        )
    except USER_ERRORS as e:
        logger.error(str(e))
        return Failed(message=str(e))


if __name__ == "__main__":
    evaluate_phase()
