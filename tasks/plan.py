"""plan: what a phase will do, before anyone trains: per dataset requested vs available, the
optimizer steps, the disk its latents use and an ETA.

The steps are counted as the trainer counts them (`sdtrain.schedules.total_optimizer_steps`
over the per-rank batches that remain after the validation hold-out), for the ranks
`launch_training` would start here; the ETA divides the samples to train by the samples/s last
measured on this data root for the same model (a run's summary), so it is "unknown" until one
run has finished.
"""

from __future__ import annotations

import json
from pathlib import Path

from catalog import Catalog, Phase
from sdtrain.config import run_config_for_phase
from sdtrain.schedules import total_optimizer_steps
from tasks import mix

TOKEN_BYTES = 77 * 4  # int32 ids per sample


def default_world_size() -> int:
    """The ranks launch_training starts on this machine: every GPU, or 2 CPU ranks."""
    import torch

    return torch.cuda.device_count() or 2


def measured_samples_per_s(root: Path, model: str) -> tuple[float, str] | None:
    """(samples/s, run) of the newest finished run of `model` under this data root."""
    found = []
    for summary in (root / "runs").glob("*/summary.json"):
        config = summary.parent / "config.json"
        if not config.is_file() or json.loads(config.read_text()).get("model") != model:
            continue
        rate = json.loads(summary.read_text()).get("samples_per_s") or 0.0
        if rate > 0:
            found.append((summary.stat().st_mtime, rate, summary.parent.name))
    if not found:
        return None
    _, rate, run = max(found)
    return rate, run


def plan_phase(
    root: Path, catalog: Catalog, phase: Phase, *, world_size: int | None = None
) -> dict:
    """The phase's plan; raises MixError as the mix would (a short dataset, nothing encoded)."""
    world_size = world_size or default_world_size()
    available = {e.dataset: mix.dataset_view(root, catalog, e.dataset).num_rows for e in phase.mix}
    datasets = mix.draw_counts(phase, available)
    num_samples = sum(d["taken"] for d in datasets)
    config = run_config_for_phase(phase, phase_dir="", run_dir="")
    num_train = max(0, num_samples - config.num_val_samples)
    batches_per_rank = num_train // world_size // config.batch_size
    steps = total_optimizer_steps(
        batches_per_rank,
        epochs=config.epochs,
        grad_accum=config.grad_accum,
        max_steps=config.max_steps,
    )
    global_batch = config.batch_size * world_size * config.grad_accum
    model = catalog.model(phase.model)
    side = model.resolution // 8
    latent_bytes = 4 * side * side * 2  # fp16 [4, side, side]
    measured = measured_samples_per_s(root, phase.model)
    samples_to_train = steps * global_batch
    return {
        "phase": phase.name,
        "datasets": datasets,
        "num_samples": num_samples,
        "num_val_samples": min(config.num_val_samples, num_samples),
        "world_size": world_size,
        "global_batch": global_batch,
        "epochs": config.epochs,
        "steps": steps,
        "latents_gb": round(num_samples * latent_bytes / 1e9, 3),
        "tokens_gb": round(num_samples * TOKEN_BYTES / 1e9, 3),
        "samples_per_s": measured[0] if measured else None,
        "measured_on": measured[1] if measured else None,
        "eta_s": round(samples_to_train / measured[0]) if measured else None,
    }


def format_plan(plan: dict) -> str:
    lines = [
        f"plan of {plan['phase']}",
        f"{'dataset':<20}{'requested':>12}{'available':>12}{'taken':>12}",
    ]
    for d in plan["datasets"]:
        mark = "  SHORT" if d["short"] else ""
        lines.append(
            f"{d['dataset']:<20}{d['requested']:>12}{d['available']:>12}{d['taken']:>12}{mark}"
        )
    eta = (
        f"{_duration(plan['eta_s'])} at {plan['samples_per_s']:.1f} samples/s "
        f"(measured by {plan['measured_on']})"
        if plan["eta_s"] is not None
        else "unknown (no finished run of this model on this data root yet)"
    )
    lines += [
        f"samples: {plan['num_samples']} ({plan['num_val_samples']} held out for validation)",
        f"steps: {plan['steps']} ({plan['epochs']} epochs, global batch {plan['global_batch']} "
        f"on {plan['world_size']} ranks)",
        f"disk: {plan['latents_gb']} GB of latents + {plan['tokens_gb']} GB of tokens "
        "(in the sources' folders; the phase set links to them)",
        f"ETA: {eta}",
    ]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"
