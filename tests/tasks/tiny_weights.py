"""A weights folder of the tiny model as training writes it (`final/`), without a training run.

The UNet is the catalog's tiny twin with seeded noise added to every weight: a freshly built one
has zero output projections, so it would ignore its prompt. Live and EMA weights differ, so a
test can tell which ones made an image.
"""

from __future__ import annotations

from pathlib import Path

import torch

from catalog import load_catalog
from sdtrain.checkpoint import write_checkpoint
from sdtrain.config import TrainConfig
from sdtrain.models import build_unet

RUN_NEGATIVE = "lowres, watermark"  # the run's negative prompt, used by its sample grids


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def write_tiny_weights(run_dir: Path) -> Path:
    """`<run_dir>/final/` with live + EMA weights and the run's config; returns run_dir."""
    state = build_unet(load_catalog().model("tiny")).state_dict()
    config = TrainConfig(
        phase="demo", phase_dir=str(run_dir / "phase"), run_dir=str(run_dir), model="tiny",
        lr=1e-4, warmup_steps=0, epochs=1, batch_size=1, cfg_dropout=0.1, min_snr_gamma=5.0,
        negative_prompt=RUN_NEGATIVE,
    )  # fmt: skip
    write_checkpoint(
        run_dir / "final", unet=_perturbed(state, 1), unet_ema=_perturbed(state, 2), config=config
    )
    return run_dir
