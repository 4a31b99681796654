"""curriculum: one phase = mix (its seeded set of datasets) -> train (torchrun DDP).

Phase N starts from phase N-1's final weights (`runs/<previous>/final/`); the flow refuses
to start a phase whose predecessor has not finished, rather than silently training from
scratch. The trainer's log lines stream into the flow run's logs.
"""

from __future__ import annotations

import re
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
from tasks import mix, shards
from tasks.train import TrainingFailed, launch_training, train_config_for_phase

STEP_LINE = re.compile(r"step (\d+)/(\d+) loss=([0-9.eE+-]+)")


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
    return catalog, phase, init_from


@task(name="mix", task_run_name="mix-{phase.name}")
def mix_task(root: Path, catalog: Catalog, phase: Phase) -> dict:
    report = mix.build_phase_set(root, catalog, phase)
    create_table_artifact(
        report["datasets"],
        key=f"{_key(phase.name)}-mix",
        description=f"{phase.name}: samples drawn per dataset",
    )
    return report


@task(name="train", task_run_name="train-{phase.name}")
def train_task(root: Path, phase: Phase, init_from: str) -> dict:
    logger = get_run_logger()
    config = train_config_for_phase(
        phase,
        phase_dir=root / "phases" / phase.name,
        run_dir=root / "runs" / phase.name,
        init_from=init_from,
    )
    progress_id = create_progress_artifact(
        0.0,
        key=f"{_key(phase.name)}-train-progress",
        description=f"{phase.name}: optimizer steps done",
    )

    def on_line(line: str) -> None:
        logger.info(line)
        if m := STEP_LINE.search(line):
            step, total = int(m.group(1)), int(m.group(2))
            update_progress_artifact(
                progress_id,
                100.0 * step / total,
                description=f"step {step}/{total} loss={m.group(3)}",
            )

    return launch_training(config, on_line=on_line)


@flow(name="curriculum", log_prints=True)
def curriculum(phase: str = "demo", data_root: str | None = None):
    """Build a phase's mix and train it, starting from the previous phase's final weights."""
    logger = get_run_logger()
    root = shards.data_root(data_root)
    try:
        catalog, spec, init_from = preflight(phase, root)
        report = mix_task(root, catalog, spec)
        summary = train_task(root, spec, init_from)
    except (CatalogError, PhaseNotReady, mix.MixError, TrainingFailed) as e:
        logger.error(str(e))
        return Failed(message=str(e))
    create_markdown_artifact(
        "\n".join(
            [
                f"# curriculum {spec.name}",
                f"- samples in the mix: {report['num_samples']}",
                f"- steps: {summary['steps']}, loss {summary['first_loss']:.4f} -> "
                f"{summary['last_loss']:.4f}, {summary['samples_per_s']:.1f} samples/s",
                f"- checkpoint: `{summary['checkpoint']}`",
                f"- sample grid: `{summary['sample_grid']}`",
            ]
        ),
        key=f"{_key(spec.name)}-train-summary",
        description=f"{spec.name}: training summary",
    )
    return summary


def _key(name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", name.lower())


if __name__ == "__main__":
    curriculum()
