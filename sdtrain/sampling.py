"""Sample grids from a UNet: DDIM with classifier-free guidance, decoded by the VAE.

x0 is never clamped: `clip_sample=False`, because latents scaled by 0.18215 are not in [-1, 1]
and clamping them (DDIM's default, meant for pixel space) washes out the samples.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

# SD1's training noise schedule; the trainer's DDPM and the sampler's DDIM must share it.
NOISE_SCHEDULE = {
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "num_train_timesteps": 1000,
}


@torch.no_grad()
def sample_latents(
    unet,
    text_emb: torch.Tensor,
    empty_emb: torch.Tensor,
    *,
    latent_shape: tuple[int, int, int],
    num_steps: int,
    guidance_scale: float,
    seed: int,
) -> torch.Tensor:
    """Latents [N, *latent_shape] for N prompt embeddings; `empty_emb` [1,77,D] is the negative."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(
        **NOISE_SCHEDULE, clip_sample=False, set_alpha_to_one=False, steps_offset=1
    )
    scheduler.set_timesteps(num_steps)
    num_images = text_emb.shape[0]
    generator = torch.Generator(text_emb.device).manual_seed(seed)
    latents = (
        torch.randn((num_images, *latent_shape), generator=generator, device=text_emb.device)
        * scheduler.init_noise_sigma
    )
    cond = torch.cat([empty_emb.expand(num_images, -1, -1), text_emb])
    for t in scheduler.timesteps:
        eps_uncond, eps_text = unet(torch.cat([latents, latents]), t, cond).sample.chunk(2)
        eps = eps_uncond + guidance_scale * (eps_text - eps_uncond)
        latents = scheduler.step(eps.float(), t, latents).prev_sample
    return latents


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
