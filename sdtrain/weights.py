"""A weights folder -> the networks it was trained with: a run's final/ or checkpoint (a fine-tune's
structure too: LoRA, 9 channels), or a diffusers pipeline folder such as an export.

Apart from sampling.py, so the sampler stays below the fine-tune modes that build on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from catalog import Model, load_catalog
from sdtrain.checkpoint import load_weights
from sdtrain.config import FinetuneSettings, TrainConfig
from sdtrain.models import build_text_encoder, build_unet, build_vae
from sdtrain.sampling import pick_device


class WeightsNotFound(Exception):
    """A path given to `sdpipe sample` / `sdpipe export` holds no trained weights."""


def is_diffusers_folder(path: str | Path) -> bool:
    """A diffusers pipeline folder (e.g. an export): model_index.json and a unet/ beside it."""
    return (Path(path) / "model_index.json").is_file() and (Path(path) / "unet").is_dir()


def resolve_weights(path: str | Path) -> Path:
    """The weights folder a path means: a run folder's final/ (else its latest checkpoint),
    a final/ folder, a checkpoint folder, or a diffusers pipeline folder."""
    path = Path(path)
    if is_diffusers_folder(path):
        return path.resolve()
    for candidate in (path, path / "final", path / "checkpoints" / "latest"):
        if (candidate / "unet_ema.safetensors").is_file() and (candidate / "config.json").is_file():
            return candidate.resolve()
    raise WeightsNotFound(
        f"{path}: no trained weights here (expected unet_ema.safetensors and config.json in it, "
        "in its final/ or in its checkpoints/latest/, or a diffusers model_index.json)"
    )


@dataclass(kw_only=True, slots=True)
class Networks:
    """A trained UNet with the frozen networks it was trained with."""

    model: Model
    prediction_type: str
    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    finetune: FinetuneSettings | None = None  # a fine-tune's structure (LoRA, 9 channels)


def load_networks(weights: str | Path, *, use_ema: bool = True, device=None) -> Networks:
    """The networks of a weights folder (see `resolve_weights`), in eval mode on `device`."""
    folder = resolve_weights(weights)
    if is_diffusers_folder(folder):
        model = load_catalog().model(str(folder))
        scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        config = None
        prediction_type = scheduler.get("prediction_type", "epsilon")
        unet, text_encoder = build_unet(model), build_text_encoder(model)
    else:
        config = TrainConfig.from_json(folder / "config.json")
        model = load_catalog().model(config.model)
        prediction_type = config.prediction_type
        unet, text_encoder = build_unet(model), build_text_encoder(model)
        if config.finetune is not None:
            from sdtrain.finetune import finetune_text_encoder, finetune_unet

            unet = finetune_unet(model, config.finetune)
            text_encoder = finetune_text_encoder(text_encoder, config.finetune, folder)
        unet.load_state_dict(load_weights(folder / f"unet{'_ema' if use_ema else ''}.safetensors"))
    device = device or pick_device()
    return Networks(
        model=model,
        prediction_type=prediction_type,
        unet=unet.to(device).eval().requires_grad_(False),
        vae=build_vae(model).to(device).eval().requires_grad_(False),
        text_encoder=text_encoder.to(device).eval().requires_grad_(False),
        finetune=config.finetune if config is not None else None,
    )
