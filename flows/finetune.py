"""finetune: a catalog fine-tune = prepare (images -> latents, class images from the base) ->
train (torchrun, the trainer's one loop) -> export, one deployment `finetune/<name>` each.

A run's `settings` (a sweep's value) override the entry's and its files land under
`<root>/finetunes/<name>/runs/<run_name>/`. Preparation holds one device of the node's GPU pool
and training `num_gpus` of them (flows/execution/pools.py), claimed devices made the ranks' visible
ones, so the runs of a sweep train side by side where the pool has slots, in turn where it has not.
On more than one node (the entry's `nodes`, or the flow's) training goes through the Ray
cluster instead, every GPU of each node (tasks/phases/train_nodes.py).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from catalog import CatalogError, Finetune, load_catalog
from flows import train_pictures
from flows.curriculum import on_nodes, parse_step_line
from flows.execution import pools
from flows.execution.stages import artifact_key
from sdtrain.models import ModelLoadError
from sdtrain.weights import WeightsNotFound
from tasks.finetune import data as ft
from tasks.generation.generate import GenerateError, GenerateFailed
from tasks.phases.train import TrainingFailed
from tasks.runtime import shards

DEFAULT_RUN = "default"


def run_name_for(settings: dict) -> str:
    """A run's folder name from its settings: `lr-2e-05`; `default` without any."""
    if not settings:
        return DEFAULT_RUN
    parts = [f"{k}-{format(v, 'g') if isinstance(v, float) else v}" for k, v in settings.items()]
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", "_".join(parts))


def preflight(name: str, settings: dict, root: Path) -> tuple[Finetune, ft.Base, list[str]]:
    """The entry with the run's settings, its base and warnings; bad input fails here, in one
    line, before any device is held."""
    spec = ft.with_overrides(load_catalog().finetune(name), settings)
    base = ft.resolve_base(spec.base, root)
    ft.image_files(ft.in_root(spec.images, root))  # exists and holds images
    warnings = []
    if spec.mode == "dreambooth" and (warning := ft.token_warning(spec.token)):
        warnings.append(f"{spec.name}: {warning}")
    return spec, base, warnings


def visible_devices(devices) -> tuple[int | None, dict[str, str]]:
    """(ranks, environment) that put torchrun's ranks on the claimed GPUs; CPU twins: the
    trainer's default (2 gloo ranks)."""
    cuda = [d.index for d in devices if d.type == "cuda"]
    if not cuda:
        return None, {}
    if visible := os.environ.get("CUDA_VISIBLE_DEVICES"):
        physical = [v.strip() for v in visible.split(",")]
        cuda = [physical[i] for i in cuda]
    return len(cuda), {"CUDA_VISIBLE_DEVICES": ",".join(map(str, cuda))}


@task(name="finetune-prepare", task_run_name="prepare-{spec.name}", cache_policy=NO_CACHE)
def prepare_task(root: Path, spec: Finetune, base: ft.Base) -> dict:
    logger = get_run_logger()
    with pools.gpu_devices(1) as devices:
        stats = ft.prepare(root, spec, base, devices=devices, on_line=logger.info)
    reasons = ", ".join(f"{r}={n}" for r, n in sorted(stats["dropped"].items())) or "-"
    converted = ", ".join(f"{r}={n}" for r, n in sorted(stats["converted"].items())) or "-"
    create_markdown_artifact(
        "\n".join(
            [
                f"# {spec.name}: data",
                f"- images kept: {stats['num_instance']}; dropped by reason: {reasons}",
                f"- converted by the image rules (kept): {converted}",
                f"- class images: {stats['num_class']}",
                *[f"- {note}" for note in stats["notes"]],
            ]
        ),
        key=artifact_key("finetune", spec.name, "data"),
        description=f"{spec.name}: images kept and dropped by reason",
    )
    return stats


@task(name="finetune-train", task_run_name="train-{spec.name}-{run_name}", cache_policy=NO_CACHE)
def train_task(
    root: Path, spec: Finetune, base: ft.Base, run_name: str, nodes: int = 0, cluster: str = ""
) -> dict:
    from tasks.phases.train import launch_training

    logger = get_run_logger()
    nodes = nodes or spec.nodes
    config = ft.train_config(root, spec, base, run_name)
    key = artifact_key("finetune", spec.name, run_name)
    progress_id = create_progress_artifact(
        0.0, key=f"{key}-progress", description=f"{spec.name}/{run_name}: optimizer steps done"
    )

    def on_line(line: str) -> None:
        logger.info(line)
        if numbers := parse_step_line(line):
            update_progress_artifact(progress_id, 100.0 * numbers["step"] / numbers["total_steps"])

    live = train_pictures.LivePictures(
        Path(config.run_dir), key=f"{key}-train-pictures", title=f"{spec.name}/{run_name}"
    )
    if on_nodes(nodes, cluster):  # the placement group holds the nodes' GPUs
        from flows.execution.cluster import train_on_nodes

        summary = train_on_nodes(
            config, nodes=nodes, cluster=cluster, on_line=live.watching(on_line)
        )
    else:
        logger.info(
            "waiting for %d device(s) of the GPU pool %r", spec.num_gpus, pools.gpu_limit_name()
        )
        with pools.gpu_devices(spec.num_gpus) as devices:
            logger.info("training on %s", ", ".join(map(str, devices)))
            nproc, env = visible_devices(devices)
            summary = launch_training(config, nproc=nproc, on_line=live.watching(on_line), env=env)
    live.refresh()
    return summary


@task(name="finetune-export", task_run_name="export-{spec.name}-{run_name}", cache_policy=NO_CACHE)
def export_task(run_dir: Path, spec: Finetune, run_name: str) -> dict:
    import torch

    from sdtrain.export import export_pipeline
    from sdtrain.weights import load_networks

    networks = load_networks(run_dir, device=torch.device("cpu"))
    folder, single_file = export_pipeline(networks, run_dir / "export")
    return {"folder": str(folder), "single_file": str(single_file)}


@flow(name="finetune", log_prints=True)
def finetune(
    name: str,
    settings: dict | None = None,
    run_name: str = "",
    data_root: str | None = None,
    nodes: int = 0,
    cluster: str = "",
):
    """Fine-tune the catalog entry `name`: DreamBooth, inpainting, optionally LoRA.

    `settings` override the entry's (e.g. {"lr": 2e-5}, as a sweep submits them); the run's
    folder is `<root>/finetunes/<name>/runs/<run_name>` (default: named by the settings). A
    rerun resumes the training from its latest checkpoint; images already encoded and class
    images already made are reused. `nodes` (0: the entry's) trains on that many nodes of the
    Ray cluster at `cluster` (else RAY_ADDRESS), every GPU of each; 1 without a cluster: here.
    """
    logger = get_run_logger()
    root = shards.data_root(data_root)
    settings = dict(settings or {})
    run_name = run_name or run_name_for(settings)
    started = time.monotonic()
    try:
        spec, base, warnings = preflight(name, settings, root)
        for warning in warnings:
            logger.warning(warning)
        data = prepare_task(root, spec, base)
        summary = train_task(root, spec, base, run_name, nodes, cluster)
        export = export_task(Path(summary["checkpoint"]).parent, spec, run_name)
    except (
        CatalogError,
        ft.FinetuneError,
        WeightsNotFound,
        ModelLoadError,
        GenerateError,
        GenerateFailed,
        TrainingFailed,
    ) as e:
        logger.error(str(e))
        return Failed(message=str(e))
    run_dir = ft.run_dir(root, spec.name, run_name)
    loading = (
        "pipe.load_lora_weights(folder) on the folder's own base pipeline"
        if spec.lora_rank
        else "StableDiffusionInpaintPipeline.from_pretrained(folder)"
        if spec.mode == "inpaint" and spec.inpaint_channels == 9
        else "StableDiffusionPipeline.from_pretrained(folder)"
    )
    create_markdown_artifact(
        "\n".join(
            [
                f"# finetune {spec.name}/{run_name} ({spec.mode}"
                + (f", LoRA rank {spec.lora_rank}" if spec.lora_rank else "")
                + ")",
                f"- base: `{base.folder}`; lr {spec.lr:g}, {summary['steps']} steps, "
                f"batch {spec.batch_size} x {summary['world_size']} ranks",
                f"- images: {data['num_instance']}, class images: {data['num_class']}",
                f"- loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; "
                f"{summary['samples_per_s']:.2f} samples/s",
                f"- export: `{export['folder']}` ({loading}), `{export['single_file']}`",
                *[f"- warning: {w}" for w in warnings],
                f"- {time.monotonic() - started:.0f} s",
                "",
                train_pictures.markdown(run_dir, "## Loss and the last grid"),
            ]
        ),
        key=artifact_key("finetune", spec.name, run_name, "summary"),
        description=f"{spec.name}/{run_name}: fine-tune summary",
    )
    return {**summary, "run_name": run_name, "export": export, "data": data}


def parse_values(text: str) -> tuple[str, list]:
    """`lr=1e-5,2e-5` -> ("lr", [1e-05, 2e-05]), each value read as YAML reads it."""
    import yaml

    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise ft.FinetuneError(f"{text!r}: expected KEY=VALUE[,VALUE...], e.g. lr=1e-5,2e-5")
    return key.strip(), [yaml.safe_load(v) for v in values.split(",") if v.strip()]


def sweep_settings(name: str, key: str, values: list, settings: dict) -> list[dict]:
    """The settings of each run of a sweep, each checked as the catalog checks the entry."""
    spec = load_catalog().finetune(name)
    runs = []
    for value in values:
        run_settings = {**settings, key: value}
        ft.with_overrides(spec, run_settings)  # a bad value fails before anything is submitted
        runs.append(run_settings)
    return runs


def submit_sweep(
    name: str, key: str, values: list, settings: dict, *, nodes: int = 0, cluster: str = ""
) -> list:
    """One flow run of deployment finetune/<name> per value (each checked first, as the
    catalog checks the entry), each on `nodes` nodes of `cluster` if given; returns the flow
    runs. Nothing is submitted if one is bad."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    runs = sweep_settings(name, key, values, settings)
    deployment = f"finetune/{name}"
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise ft.FinetuneError(
                f"deployment {deployment} is not on the server at {client.api_url}: "
                "`prefect deploy --all` (or python -m flows.cli.serve) first"
            ) from None
    return [
        run_deployment(
            deployment,
            parameters={"name": name, "settings": s, "run_name": run_name_for(s)}
            | ({"nodes": nodes} if nodes else {})
            | ({"cluster": cluster} if cluster else {}),
            timeout=0,
        )
        for s in runs
    ]


def wait_for(flow_runs: list, poll_s: float = 2.0) -> list:
    """The flow runs once every one has ended (their final states)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while True:
            current = [client.read_flow_run(r.id) for r in flow_runs]
            if all(r.state is not None and r.state.is_final() for r in current):
                return current
            time.sleep(poll_s)


if __name__ == "__main__":
    finetune()
