"""Images from a UNet: DDIM with classifier-free guidance against a real negative prompt.

x0 is never clamped (`clip_sample=False`): latents x 0.18215 are not bounded by [-1, 1], and
DDIM's pixel-space clamp washes samples out. The sampler shares the trainer's alphas, and
`sdpipe sample` uses the EMA weights unless asked for the live ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from sdtrain.lazy import BUILD_LOCK
from sdtrain.models import tokenize
from sdtrain.objective import NOISE_SCHEDULE

if TYPE_CHECKING:
    from sdtrain.weights import Networks


def ddim_scheduler(prediction_type: str = "epsilon"):
    with BUILD_LOCK:  # diffusers imports lazily, which is not thread-safe
        from diffusers import DDIMScheduler

    return DDIMScheduler(
        **NOISE_SCHEDULE,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=prediction_type,
    )


@torch.no_grad()
def encode_text(text_encoder, input_ids: torch.Tensor) -> torch.Tensor:
    """The frozen CLIP text encoder's last_hidden_state [N, 77, D] for token ids [N, 77]."""
    return text_encoder(input_ids.to(text_encoder.device)).last_hidden_state


@torch.no_grad()
def sample_latents(
    unet,
    text_emb: torch.Tensor,
    negative_emb: torch.Tensor,
    *,
    latent_shape: tuple[int, int, int],
    num_steps: int,
    guidance_scale: float,
    seed: int | Sequence[int],
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """Latents [N, *latent_shape] for N prompt embeddings, guided away from `negative_emb`.

    `negative_emb` is [1, 77, D] (one negative prompt for all) or [N, 77, D]. The initial noise
    is drawn on the CPU, so a seed gives the same images on CUDA, MPS and CPU. One seed draws
    the whole batch's noise; N seeds draw each image's own, so an image does not depend on the
    batch it was made in (batch generation resumes and splits work on that).
    """
    scheduler = ddim_scheduler(prediction_type)
    scheduler.set_timesteps(num_steps)
    num_images = text_emb.shape[0]
    latents = initial_noise(num_images, latent_shape, seed).to(text_emb.device)
    latents = latents * scheduler.init_noise_sigma
    cond = torch.cat([negative_emb.expand(num_images, -1, -1), text_emb])
    for t in scheduler.timesteps:
        out_negative, out_text = unet(torch.cat([latents, latents]), t, cond).sample.chunk(2)
        out = out_negative + guidance_scale * (out_text - out_negative)
        latents = scheduler.step(out.float(), t, latents).prev_sample
    return latents


def initial_noise(
    num_images: int, latent_shape: tuple[int, ...], seed: int | Sequence[int]
) -> torch.Tensor:
    if isinstance(seed, int):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn((num_images, *latent_shape), generator=generator)
    if len(seed) != num_images:
        raise ValueError(f"{len(seed)} seeds for {num_images} images")
    return torch.cat(
        [torch.randn((1, *latent_shape), generator=torch.Generator().manual_seed(s)) for s in seed]
    )


@torch.no_grad()
def decode_images(vae, latents: torch.Tensor, scaling_factor: float) -> list[Image.Image]:
    pixels = vae.decode(latents.to(vae.dtype) / scaling_factor).sample
    pixels = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return [Image.fromarray(p) for p in pixels.permute(0, 2, 3, 1).cpu().numpy()]


def image_grid(images: list[Image.Image], num_cols: int = 4) -> Image.Image:
    num_cols = min(num_cols, len(images))
    num_rows = math.ceil(len(images) / num_cols)
    w, h = images[0].size
    grid = np.zeros((num_rows * h, num_cols * w, 3), dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, num_cols)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = np.asarray(image.convert("RGB"))
    return Image.fromarray(grid)


def pick_device() -> torch.device:
    """CUDA, else Apple's MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def generate(
    networks: Networks,
    prompts: list[str],
    *,
    negative_prompt: str = "",
    num_steps: int = 100,
    guidance_scale: float = 7.5,
    seed: int | Sequence[int] = 0,
) -> list[Image.Image]:
    """One image per prompt: DDIM, no x0 clamp, CFG against `negative_prompt`; `seed`: one for
    the batch, or one per prompt (see `sample_latents`)."""
    device = networks.unet.device
    text_emb = encode_text(networks.text_encoder, tokenize(prompts))
    negative_emb = encode_text(networks.text_encoder, tokenize([negative_prompt]))
    side = networks.model.resolution // 8
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    with torch.autocast(device.type, dtype or torch.float16, enabled=device.type == "cuda"):
        latents = sample_latents(
            networks.unet,
            text_emb,
            negative_emb,
            latent_shape=(networks.unet.config.in_channels, side, side),
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            seed=seed,
            prediction_type=networks.prediction_type,
        )
    return decode_images(networks.vae, latents.float(), networks.model.scaling_factor)
