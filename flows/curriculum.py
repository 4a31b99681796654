"""curriculum: one phase = plan -> mix (its seeded set of datasets) -> train (torchrun DDP).

The plan (requested vs available per dataset, steps, disk, ETA), for the nodes and ranks the
training will start, is published first and a phase short of data fails there, before any
training. While the phase's run has checkpoints, its phase set is reused, so a resume trains on
the rows it started on (or, after a removal re-linked it, resumes on it without the removed
rows: `resume_remixed`, a new lineage segment). Phase N starts from phase N-1's final weights
and the flow refuses to start before they exist. After training, the phase is evaluated on its
eval set (flows/evaluate.py), whose networks are checked before training starts.
Trainer lines stream into the logs and a progress artifact. A training holds the slots of its
node's GPU pool (flows/execution/pools.py: the global concurrency limit `sdpipe-gpu-<pool>`) for
every GPU it uses, so it never shares GPUs with score/encode shards or another training; on more
than one node (the phase's `nodes`, or the flow's) it trains through the Ray cluster, whose
placement group holds the nodes' GPUs instead (tasks/phases/train_nodes.py). A failed
training leaves `runs/<phase>/failed.json` (for `sdpipe status`); a successful one removes it.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.states import Failed

from catalog import Catalog, CatalogError, Phase, load_catalog
from flows import evaluate, lineage, train_pictures
from flows.execution import pools
from flows.execution.credentials import export_secrets
from tasks.phases import mix, plan
from tasks.phases.train import (
    TrainingFailed,
    launch_training,
    on_nodes,
    train_config_for_phase,
)
from tasks.runtime import shards

STEP_LINE = re.compile(r"step (\d+)/(\d+) loss=([0-9.eE+-]+).*? samples/s=([0-9.]+)")


class PhaseNotReady(Exception):
    """The phase this one starts from has no final weights yet."""


def preflight(phase_name: str, root: Path) -> tuple[Catalog, Phase, str]:
    """The catalog, the phase and the folder of the weights it starts from ('' = scratch)."""
    catalog = load_catalog()
    phase = catalog.phase(phase_name)
    init_from = ""
    if phase.init_from:
        final = root / "runs" / phase.init_from / "final"
        if not (final / "unet.safetensors").exists():
            raise PhaseNotReady(
                f"{phase.name} starts from {phase.init_from}'s final weights, which do not exist "
                f"({final}); run curriculum/{phase.init_from} first"
            )
        init_from = str(final)
    evaluate.check_networks(catalog, phase.name)  # missing now, not after the training
    return catalog, phase, init_from


@task(name="plan", task_run_name="plan-{phase.name}")
def plan_task(
    root: Path, catalog: Catalog, phase: Phase, nodes: int = 0, cluster: str = ""
) -> dict:
    """The phase's plan for the ranks `train_task` starts with the same `nodes` and `cluster`."""
    report = plan.plan_phase(root, catalog, phase, nodes=nodes, cluster=cluster)
    get_run_logger().info(plan.format_plan(report))
    create_markdown_artifact(
        "\n".join(["```", plan.format_plan(report), "```"]),
        key=f"{_key(phase.name)}-plan",
        description=f"{phase.name}: requested vs available, steps, disk, ETA",
    )
    return report


@task(name="mix", task_run_name="mix-{phase.name}")
def mix_task(root: Path, catalog: Catalog, phase: Phase) -> dict:
    report = mix.phase_set_for_run(root, catalog, phase)
    if report["remixed"]:
        get_run_logger().info(
            f"{phase.name}: its phase set was re-linked by removal "
            f"{', '.join(r[:12] for r in report['remixed'])}; training resumes from its latest "
            "checkpoint on the set without the removed rows (a new lineage segment)"
        )
    elif report["reused"]:
        get_run_logger().info(
            f"{phase.name}: its run has checkpoints; training resumes on its phase set as it "
            "is (delete runs/<phase>/checkpoints to draw a new mix)"
        )
    create_table_artifact(
        report["datasets"],
        key=f"{_key(phase.name)}-mix",
        description=f"{phase.name}: samples drawn per dataset",
    )
    return report


def parse_step_line(line: str) -> dict | None:
    """The numbers of a trainer console line `step 10/5000 loss=0.1823 ... samples/s=12.3`."""
    m = STEP_LINE.search(line)
    if m is None:
        return None
    return {
        "step": int(m.group(1)),
        "total_steps": int(m.group(2)),
        "loss": float(m.group(3)),
        "samples_per_s": float(m.group(4)),
    }


def training_slot_name() -> str:
    """The GPU pool limit a training holds (one pool per node unless SDPIPE_GPU_POOL says)."""
    return pools.gpu_limit_name()


@contextlib.contextmanager
def training_slot() -> Iterator[None]:
    """Hold one slot of the GPU pool per GPU this node's training uses (1 on a CPU node)."""
    get_run_logger().info(f"waiting for the GPU pool {training_slot_name()!r}")
    with pools.gpu_slot(occupy=max(1, pools.local_gpus())):
        yield


@task(name="train", task_run_name="train-{phase.name}")
def train_task(
    root: Path,
    phase: Phase,
    init_from: str,
    wandb_project: str = "",
    nodes: int = 0,
    cluster: str = "",
    resume_remixed: bool = False,
) -> dict:
    logger = get_run_logger()
    nodes = nodes or phase.nodes
    config = train_config_for_phase(
        phase,
        phase_dir=root / "phases" / phase.name,
        run_dir=root / "runs" / phase.name,
        init_from=init_from,
        resume_remixed=resume_remixed,
    )
    config.wandb_project = wandb_project
    progress_id = create_progress_artifact(
        0.0,
        key=f"{_key(phase.name)}-train-progress",
        description=f"{phase.name}: optimizer steps done",
    )

    def on_line(line: str) -> None:
        logger.info(line)
        if numbers := parse_step_line(line):
            update_progress_artifact(
                progress_id,
                100.0 * numbers["step"] / numbers["total_steps"],
                description=(
                    f"{phase.name}: step {numbers['step']}/{numbers['total_steps']}, "
                    f"loss {numbers['loss']:.4f}, {numbers['samples_per_s']:.1f} samples/s"
                ),
            )

    live = train_pictures.LivePictures(
        root / "runs" / phase.name, key=f"{_key(phase.name)}-train-pictures", title=phase.name
    )
    failure = root / "runs" / phase.name / "failed.json"
    start = time.monotonic()
    try:
        if on_nodes(nodes, cluster):
            from flows.execution.cluster import train_on_nodes

            summary = train_on_nodes(
                config, nodes=nodes, cluster=cluster, on_line=live.watching(on_line)
            )
        else:
            with training_slot():
                summary = launch_training(config, on_line=live.watching(on_line))
    except Exception as e:
        shards.write_failure(failure, e, time.monotonic() - start)
        raise
    failure.unlink(missing_ok=True)
    live.refresh()  # the final grid
    return summary


@flow(name="curriculum", log_prints=True)
def curriculum(
    phase: str = "demo",
    data_root: str | None = None,
    wandb_project: str = "",
    nodes: int = 0,
    cluster: str = "",
):
    """Build a phase's mix and train it, starting from the previous phase's final weights.

    A rerun after a failure or cancellation resumes the training from its latest checkpoint;
    `wandb_project` also logs the training to Weights & Biases (needs `pip install wandb`).
    `nodes` (0: the phase's) trains on that many nodes of the Ray cluster at `cluster` (else
    RAY_ADDRESS), every GPU of each, and the plan counts their ranks; 1 without a cluster
    trains here.
    """
    logger = get_run_logger()
    root = shards.data_root(data_root)
    export_secrets()  # WANDB_API_KEY (HF_TOKEN): env or Secret block, masked in logs
    try:
        catalog, spec, init_from = preflight(phase, root)
        if not mix.run_has_checkpoints(root, spec.name):  # a resume keeps its phase set
            plan_task(root, catalog, spec, nodes, cluster)
        report = mix_task(root, catalog, spec)
        remixed = bool(report.get("remixed"))  # a removal re-linked the set since
        summary = train_task(root, spec, init_from, wandb_project, nodes, cluster, remixed)
        scores = evaluate.eval_task(root, spec.name) if spec.eval_set else None
    except (CatalogError, PhaseNotReady, mix.MixError, TrainingFailed, *evaluate.USER_ERRORS) as e:
        logger.error(str(e))
        return Failed(message=str(e))
    create_markdown_artifact(
        "\n".join(
            [
                f"# curriculum {spec.name}",
                f"- samples in the mix: {report['num_samples']}",
                *([f"- {line}"] if (line := bucket_line(summary)) else []),
                f"- steps: {summary['steps']}/{summary['total_steps']} on "
                f"{summary['world_size']} ranks (resumed from step {summary['resumed_from_step']})",
                f"- loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; best "
                f"validation loss (EMA): {summary['best_val_loss']}",
                f"- {summary['samples_per_s']:.1f} samples/s, data wait "
                f"{100 * summary['data_wait_fraction']:.1f}% of the loop",
                f"- final weights (live + EMA): `{summary['checkpoint']}`",
                f"- best checkpoint: `{summary['best_checkpoint']}`",
                f"- sample grid (EMA): `{summary['sample_grid']}`",
                f"- eval ({spec.eval_set}): artifacts `{evaluate.artifact_key(spec.name, 'table')}`"
                f", `{evaluate.artifact_key(spec.name, 'grid')}`; mean CLIP score "
                f"{scores['metrics']['all']['clip_score']:.2f}"
                if scores
                else "- eval: none (the phase names no eval set)",
                "",
                train_pictures.markdown(root / "runs" / spec.name, "## Loss and final samples"),
            ]
        ),
        key=f"{_key(spec.name)}-train-summary",
        description=f"{spec.name}: training summary",
    )
    lineage.publish_removed_flags(root)  # a checkpoint on rows removed since, flagged
    return summary


def _key(name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", name.lower())


if __name__ == "__main__":
    curriculum()


def bucket_line(summary: dict) -> str | None:
    """A run summary's training rows per aspect bucket, and those left out; None: one bucket."""
    buckets = summary.get("buckets")
    if not buckets:
        return None
    left = sum((summary.get("left_out") or {}).values())
    small = ", ".join(f"{b} {n}" for b, n in (summary.get("small_buckets") or {}).items())
    return (
        "aspect buckets (training rows): "
        + ", ".join(f"{name} {rows}" for name, rows in buckets.items())
        + (f"; {left} rows left out as small_bucket ({small})" if left else "")
    )
