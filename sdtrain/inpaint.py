"""Inpainting: masks, the 9-channel UNet's input, and the denoising loop that fills a mask.

A mask is 1 where the image is to be filled and 0 where it is known (the convention of
diffusers' `StableDiffusionInpaintPipeline`). A 4-channel UNet inpaints as seed 000 does: the
known region, noised to the next step's level, is re-imposed after every step. A 9-channel
UNet sees [noisy latents, mask, masked-image latents] and fills the hole itself; its extra
input channels start at zero, so it starts as the 4-channel model it was expanded from.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from sdtrain.sampling import ddim_scheduler, decode_images, image_grid, initial_noise

INPAINT_CHANNELS = 9  # noisy latents (4) + mask (1) + masked-image latents (4)
MASK_STREAM = 2  # the draws of training masks (objective.py: 0 training noise, 1 validation)
FULL_MASK_SHARE = 0.25  # training masks that hide the whole image: the model keeps generating


def expand_conv_in(unet, in_channels: int = INPAINT_CHANNELS) -> None:
    """Widen the UNet's first convolution to `in_channels`, the new input channels zeroed."""
    old = unet.conv_in
    if old.in_channels == in_channels:
        return
    new = torch.nn.Conv2d(
        in_channels, old.out_channels, old.kernel_size, old.stride, old.padding
    ).to(old.weight.device, old.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()
        new.weight[:, : old.in_channels] = old.weight
        new.bias.copy_(old.bias)
    unet.conv_in = new
    unet.register_to_config(in_channels=in_channels)


def rectangle(rng: np.random.Generator, size: int, low: float, high: float) -> tuple[int, ...]:
    """(top, left, height, width) of a rectangle whose sides are `low`..`high` of `size`."""
    h, w = (int(size * rng.uniform(low, high)) for _ in range(2))
    return int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1)), h, w


def training_masks(rows: torch.Tensor, *, seed: int, epoch: int, size: int) -> torch.Tensor:
    """Masks [B, 1, size, size] f32 for phase-set rows, drawn from (seed, epoch, row): a quarter
    hide everything, the others 1-3 random rectangles of 10-70% of each side."""
    masks = np.zeros((len(rows), 1, size, size), np.float32)
    for i, row in enumerate(rows.tolist()):
        rng = np.random.default_rng((seed, MASK_STREAM, epoch, row))
        if rng.random() < FULL_MASK_SHARE:
            masks[i] = 1.0
            continue
        for _ in range(int(rng.integers(1, 4))):
            top, left, h, w = rectangle(rng, size, 0.1, 0.7)
            masks[i, 0, top : top + h, left : left + w] = 1.0
    return torch.from_numpy(masks)


def demo_masks(num_images: int, *, size: int, seed: int) -> torch.Tensor:
    """One random rectangle per demo image (a quarter to a half of each side), fixed by seed."""
    rng = np.random.default_rng((seed, MASK_STREAM, 2**32 - 1))  # an epoch no run reaches
    masks = torch.zeros((num_images, 1, size, size))
    for i in range(num_images):
        top, left, h, w = rectangle(rng, size, 0.25, 0.5)
        masks[i, 0, top : top + h, left : left + w] = 1.0
    return masks


def to_unit_range(pixels_BHWC: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> f32 [B, 3, H, W] in [-1, 1], the VAE's input."""
    return pixels_BHWC.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def latent_mask(mask_B1HW: torch.Tensor, latent_side: int) -> torch.Tensor:
    """The mask at latent resolution, as the diffusers pipeline resizes it (nearest)."""
    return F.interpolate(mask_B1HW, size=(latent_side, latent_side))


@torch.no_grad()
def masked_image_latents(
    vae, pixels_BHWC: torch.Tensor, mask_B1HW: torch.Tensor, scaling_factor: float
) -> torch.Tensor:
    """VAE latents (posterior mean x scaling) of the image with its masked pixels at 0 (gray),
    as the pipeline builds `masked_image = image * (mask < 0.5)`."""
    x = to_unit_range(pixels_BHWC) * (mask_B1HW < 0.5)
    return vae.encode(x.to(vae.dtype)).latent_dist.mean.float() * scaling_factor


@torch.no_grad()
def inpaint_latents(
    unet,
    image_latents: torch.Tensor,
    mask: torch.Tensor,
    masked_latents: torch.Tensor | None,
    text_emb: torch.Tensor,
    negative_emb: torch.Tensor | None,
    *,
    num_steps: int,
    guidance_scale: float,
    seed: int,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """Fill `mask` (1 = fill, latent resolution) of `image_latents` by DDIM.

    9-channel UNets see the mask and `masked_latents`; 4-channel ones get the known region
    re-imposed (noised to the next step's level) after every step. `negative_emb` None: no
    CFG (the unconditional mode's null embedding has nothing to guide away from).
    """
    scheduler = ddim_scheduler(prediction_type)
    scheduler.set_timesteps(num_steps)
    n = image_latents.shape[0]
    noise = initial_noise(n, tuple(image_latents.shape[1:]), seed).to(image_latents.device)
    latents = noise * scheduler.init_noise_sigma
    nine = unet.config.in_channels == INPAINT_CHANNELS
    cond = (
        text_emb if negative_emb is None else torch.cat([negative_emb.expand(n, -1, -1), text_emb])
    )
    copies = 1 if negative_emb is None else 2
    timesteps = scheduler.timesteps
    for i, t in enumerate(timesteps):
        x = torch.cat([latents, mask, masked_latents], dim=1) if nine else latents
        out = unet(torch.cat([x] * copies), t, cond).sample
        if copies == 2:
            out_negative, out_text = out.chunk(2)
            out = out_negative + guidance_scale * (out_text - out_negative)
        latents = scheduler.step(out.float(), t, latents).prev_sample
        if not nine:
            if i + 1 < len(timesteps):
                known = scheduler.add_noise(image_latents, noise, timesteps[i + 1 : i + 2])
            else:
                known = image_latents
            latents = (1 - mask) * known + mask * latents
    return latents


def demo_grid(
    unet,
    vae,
    pixels_BHWC: torch.Tensor,
    image_latents: torch.Tensor,
    text_emb: torch.Tensor,
    negative_emb: torch.Tensor | None,
    *,
    scaling_factor: float,
    num_steps: int,
    guidance_scale: float,
    seed: int,
    prediction_type: str,
) -> Image.Image:
    """Rows: the images with a random rectangle grayed out, the model's fill, the originals."""
    n, size = pixels_BHWC.shape[0], pixels_BHWC.shape[1]
    device = image_latents.device
    mask = demo_masks(n, size=size, seed=seed).to(device)
    small_mask = latent_mask(mask, image_latents.shape[-1])
    masked = None
    if unet.config.in_channels == INPAINT_CHANNELS:
        masked = masked_image_latents(vae, pixels_BHWC, mask, scaling_factor)
    latents = inpaint_latents(
        unet,
        image_latents,
        small_mask,
        masked,
        text_emb,
        negative_emb,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        seed=seed,
        prediction_type=prediction_type,
    )
    filled = decode_images(vae, latents.float(), scaling_factor)
    keep = (mask[:, 0, :, :, None] < 0.5).cpu()
    grayed = torch.where(keep, pixels_BHWC.cpu(), torch.full_like(pixels_BHWC.cpu(), 127))
    originals = [Image.fromarray(p) for p in pixels_BHWC.cpu().numpy()]
    return image_grid([Image.fromarray(p) for p in grayed.numpy()] + filled + originals, num_cols=n)
