"""Export trained weights: a diffusers folder and one original-layout (LDM) safetensors file.

The folder is a `StableDiffusionPipeline` with the trainer's DDIM (no x0 clamp); a 9-channel
UNet's is a `StableDiffusionInpaintPipeline`, and a LoRA fine-tune's is its frozen base plus the
adapters for `pipe.load_lora_weights(folder)`. The single file (the adapters merged in) uses the
original checkpoint names (`model.diffusion_model.`, `first_stage_model.`,
`cond_stage_model.transformer.`), mapped from the UNet and VAE configs, not a fixed SD1.5 table.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from sdtrain.atomic import TMP_MARK, atomic_path
from sdtrain.sampling import ddim_scheduler
from sdtrain.weights import Networks

RESNET_TO_LDM = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
VAE_ATTENTION_TO_LDM = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}


def export_pipeline(networks: Networks, out_dir: Path, *, half: bool = False) -> tuple[Path, Path]:
    """Write `out_dir/` (diffusers) and `out_dir.safetensors` (single file); returns both."""
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline

    from sdtrain import lora
    from sdtrain.models import build_tokenizer

    dtype = torch.float16 if half else torch.float32
    unet, text_encoder = networks.unet.to("cpu", dtype), networks.text_encoder.to("cpu", dtype)
    adapted = lora.has_lora(unet)
    if adapted:  # the pipeline holds the frozen base; the adapters go beside it
        unet, text_encoder = (_without_lora(m) for m in (unet, text_encoder))
    nine = unet.config.in_channels == 9
    pipeline_class = StableDiffusionInpaintPipeline if nine else StableDiffusionPipeline
    pipeline = pipeline_class(
        vae=networks.vae.to("cpu", dtype),
        text_encoder=text_encoder,
        tokenizer=build_tokenizer(),
        unet=unet,
        scheduler=ddim_scheduler(networks.prediction_type),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}{TMP_MARK}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipeline.save_pretrained(tmp)
    if adapted:
        from sdtrain.finetune import unet_targets

        settings = networks.finetune
        lora.save_adapters(
            tmp,
            networks.unet,
            networks.text_encoder,
            rank=settings.lora_rank,
            alpha=settings.lora_alpha,
            unet_targets=unet_targets(settings),
        )
        unet, text_encoder = (_merged(m) for m in (networks.unet, networks.text_encoder))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)

    single_file = out_dir.with_name(out_dir.name + ".safetensors")
    state = ldm_state_dict(unet, networks.vae, text_encoder)
    with atomic_path(single_file) as tmp_file:
        save_file(state, str(tmp_file), metadata={"format": "pt"})
    return out_dir, single_file


def _plain_copy(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module of `module`'s class and config (no adapters) holding `state`."""
    if hasattr(module, "register_to_config"):  # a diffusers model
        plain = type(module).from_config(module.config)
    else:  # a transformers model
        plain = type(module)(module.config)
    plain.load_state_dict(state)
    return plain.to(next(module.parameters()).dtype)


def _without_lora(module: torch.nn.Module) -> torch.nn.Module:
    from sdtrain import lora

    if not lora.has_lora(module):
        return module
    return _plain_copy(module, lora.base_state(module.state_dict()))


def _merged(module: torch.nn.Module) -> torch.nn.Module:
    """The module with its adapters folded into its weights (for the single file)."""
    from sdtrain import lora

    if not lora.has_lora(module):
        return module
    return _plain_copy(module, lora.merged_state(module))


def ldm_state_dict(unet, vae, text_encoder) -> dict[str, torch.Tensor]:
    """The three networks' weights under the original Stable Diffusion checkpoint's names."""
    state = {}
    unet_names = _unet_prefixes(unet.config)
    for key, value in unet.state_dict().items():
        state["model.diffusion_model." + _rename(key, unet_names, RESNET_TO_LDM)] = value
    vae_names = _vae_prefixes(vae.config)
    for key, value in vae.state_dict().items():
        ldm_key = _rename(key, vae_names, {"conv_shortcut": "nin_shortcut"})
        if ".mid.attn_1." in ldm_key:
            ldm_key = _rename_inner(ldm_key, ".mid.attn_1.", VAE_ATTENTION_TO_LDM)
            if value.ndim == 2:  # the original attention projections are 1x1 convolutions
                value = value[:, :, None, None]
        state["first_stage_model." + ldm_key] = value
    for key, value in text_encoder.state_dict().items():
        # transformers 5 names CLIPTextModel's weights without the `text_model.` of the original.
        key = key if key.startswith("text_model.") else "text_model." + key
        state["cond_stage_model.transformer." + key] = value
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def _rename(key: str, prefixes: dict[str, str], inner: dict[str, str]) -> str:
    """`key` with its longest mapped prefix replaced; resnet layer names renamed by `inner`."""
    for old in sorted(prefixes, key=len, reverse=True):
        if key.startswith(old):
            new = prefixes[old]
            rest = key[len(old) :]
            if ".resnets." in old:
                head, _, tail = rest.partition(".")
                rest = f"{inner.get(head, head)}.{tail}"
            return new + rest
    return key


def _rename_inner(key: str, marker: str, names: dict[str, str]) -> str:
    head, _, rest = key.partition(marker)
    for old, new in names.items():
        if rest.startswith(old + "."):
            return f"{head}{marker}{new}{rest[len(old) :]}"
    return key


def _unet_prefixes(config) -> dict[str, str]:
    """diffusers UNet2DConditionModel prefixes -> original `input_blocks`/`output_blocks` ones."""
    num_blocks = len(config["block_out_channels"])
    per_block = config["layers_per_block"]
    names = {
        "time_embedding.linear_1.": "time_embed.0.",
        "time_embedding.linear_2.": "time_embed.2.",
        "conv_in.": "input_blocks.0.0.",
        "conv_norm_out.": "out.0.",
        "conv_out.": "out.2.",
        "mid_block.resnets.0.": "middle_block.0.",
        "mid_block.attentions.0.": "middle_block.1.",
        "mid_block.resnets.1.": "middle_block.2.",
    }
    for i, kind in enumerate(config["down_block_types"]):
        for j in range(per_block):
            index = (per_block + 1) * i + j + 1
            names[f"down_blocks.{i}.resnets.{j}."] = f"input_blocks.{index}.0."
            if kind.startswith("CrossAttn"):
                names[f"down_blocks.{i}.attentions.{j}."] = f"input_blocks.{index}.1."
        if i < num_blocks - 1:
            index = (per_block + 1) * (i + 1)
            names[f"down_blocks.{i}.downsamplers.0.conv."] = f"input_blocks.{index}.0.op."
    for i, kind in enumerate(config["up_block_types"]):
        has_attention = kind.startswith("CrossAttn")
        for j in range(per_block + 1):
            index = (per_block + 1) * i + j
            names[f"up_blocks.{i}.resnets.{j}."] = f"output_blocks.{index}.0."
            if has_attention:
                names[f"up_blocks.{i}.attentions.{j}."] = f"output_blocks.{index}.1."
        if i < num_blocks - 1:
            index = (per_block + 1) * i + per_block
            names[f"up_blocks.{i}.upsamplers.0."] = (
                f"output_blocks.{index}.{2 if has_attention else 1}."
            )
    return names


def _vae_prefixes(config) -> dict[str, str]:
    """diffusers AutoencoderKL prefixes -> original `encoder.down`/`decoder.up` ones."""
    num_blocks = len(config["block_out_channels"])
    per_block = config["layers_per_block"]
    names = {
        "encoder.conv_norm_out.": "encoder.norm_out.",
        "decoder.conv_norm_out.": "decoder.norm_out.",
    }
    for part in ("encoder", "decoder"):
        names[f"{part}.mid_block.attentions.0."] = f"{part}.mid.attn_1."
        for j in range(2):
            names[f"{part}.mid_block.resnets.{j}."] = f"{part}.mid.block_{j + 1}."
    for i in range(num_blocks):
        for j in range(per_block):
            names[f"encoder.down_blocks.{i}.resnets.{j}."] = f"encoder.down.{i}.block.{j}."
        for j in range(per_block + 1):
            up = num_blocks - 1 - i  # the original numbers decoder blocks from the bottom
            names[f"decoder.up_blocks.{i}.resnets.{j}."] = f"decoder.up.{up}.block.{j}."
        if i < num_blocks - 1:
            names[f"encoder.down_blocks.{i}.downsamplers.0."] = f"encoder.down.{i}.downsample."
            names[f"decoder.up_blocks.{i}.upsamplers.0."] = (
                f"decoder.up.{num_blocks - 1 - i}.upsample."
            )
    return names
