"""LoRA adapters (peft) on the UNet and text encoder, and their export as diffusers loads them.

Checkpoints keep the adapted modules' own state (`...to_q.base_layer.weight`,
`...to_q.lora_A.default.weight`), so a resume rebuilds the same modules and loads it. Export
splits it: the frozen base as a pipeline, the adapters as `pytorch_lora_weights.safetensors`
for `pipe.load_lora_weights(folder)`. The text encoder's adapters are injected with peft
directly: transformers' own `add_adapter` asks for a newer peft than the one pinned here.
"""

from __future__ import annotations

from pathlib import Path

import torch

UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' DreamBooth LoRA targets
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
LORA_FILE = "pytorch_lora_weights.safetensors"


def lora_config(rank: int, alpha: float, targets: tuple[str, ...]):
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets)
    )


def add_lora(module: torch.nn.Module, *, rank: int, alpha: float, targets, seed: int) -> None:
    """Inject adapters (A gaussian from `seed`, B zero: the module's output is unchanged) and
    freeze everything else."""
    from peft import inject_adapter_in_model

    module.requires_grad_(False)
    torch.manual_seed(seed)
    inject_adapter_in_model(lora_config(rank, alpha, tuple(targets)), module)
    for name, p in module.named_parameters():
        p.requires_grad_(is_lora(name))


def is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_lora(module: torch.nn.Module) -> bool:
    return any(is_lora(name) for name, _ in module.named_parameters())


def base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base's weights under the plain module's names."""
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_lora(k)}


def adapter_layers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters in the naming `save_lora_weights` / `load_lora_weights` use."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import get_peft_model_state_dict

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(module))


def merged_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Base + adapters folded into plain weights (the module is left merged)."""
    from peft.tuners.lora import LoraLayer

    for layer in module.modules():
        if isinstance(layer, LoraLayer):
            layer.merge()
    return base_state(module.state_dict())


def save_adapters(
    folder: Path, unet, text_encoder, *, rank: int, alpha: float, unet_targets
) -> Path:
    """`folder/pytorch_lora_weights.safetensors` with the UNet's (and a trained text encoder's)
    adapters, their rank and alpha in its metadata."""
    from diffusers import StableDiffusionPipeline

    text = text_encoder if text_encoder is not None and has_lora(text_encoder) else None
    StableDiffusionPipeline.save_lora_weights(
        str(folder),
        unet_lora_layers=adapter_layers(unet),
        text_encoder_lora_layers=adapter_layers(text) if text is not None else None,
        unet_lora_adapter_metadata=lora_config(rank, alpha, tuple(unet_targets)).to_dict(),
        text_encoder_lora_adapter_metadata=(
            lora_config(rank, alpha, TEXT_TARGETS).to_dict() if text is not None else None
        ),
        weight_name=LORA_FILE,
    )
    return folder / LORA_FILE
