"""The diffusion objective: DDPM noising, epsilon or v targets, min-SNR weights, CFG dropout.

A training sample's random draws (timestep, noise, offset, CFG drop) come from a generator seeded
by (seed, epoch, row): a run's numbers depend neither on the number of ranks nor on where it was
resumed. One noise schedule serves training, validation and the DDIM sampler.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sdtrain.lazy import once

# SD1's training noise schedule; the trainer's DDPM and the sampler's DDIM share it.
NOISE_SCHEDULE = {
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "num_train_timesteps": 1000,
}
TRAIN_STREAM, VALIDATION_STREAM = 0, 1
# The data's own draws (sdtrain.data): a row's flip and latent draw per (seed, stream, epoch,
# row), an epoch's batch order per (seed, stream, epoch). 2 is inpainting's masks (inpaint.py).
FLIP_STREAM, LATENT_STREAM, ORDER_STREAM = 3, 4, 5


def alphas_cumprod(device: torch.device | str = "cpu") -> torch.Tensor:
    """alpha-bar_t, float32 [1000], exactly as diffusers' DDPM and DDIM schedulers hold it."""
    return _alphas_cumprod(str(device))


@once
def _alphas_cumprod(device: str) -> torch.Tensor:
    # One copy per device: a per-step host-to-device copy would stall the CUDA stream.
    from diffusers import DDPMScheduler

    return DDPMScheduler(**NOISE_SCHEDULE).alphas_cumprod.to(device)


def draw_noise(
    rows: torch.Tensor,
    *,
    seed: int,
    epoch: int,
    latent_shape: tuple[int, ...],
    cfg_dropout: float = 0.0,
    offset_noise: float = 0.0,
    stream: int = TRAIN_STREAM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise [B,*latent_shape] f32, timesteps [B] int64, dropped [B] bool) for phase-set rows."""
    num_timesteps = NOISE_SCHEDULE["num_train_timesteps"]
    noise = np.empty((len(rows), *latent_shape), dtype=np.float32)
    timesteps = np.empty(len(rows), dtype=np.int64)
    dropped = np.empty(len(rows), dtype=bool)
    for i, row in enumerate(rows.tolist()):
        rng = np.random.default_rng((seed, stream, epoch, row))
        timesteps[i] = rng.integers(num_timesteps)
        dropped[i] = rng.random() < cfg_dropout
        noise[i] = rng.standard_normal(latent_shape, dtype=np.float32)
        if offset_noise:  # a per-channel shift: lets the model learn very dark and bright images
            noise[i] += offset_noise * rng.standard_normal((latent_shape[0], 1, 1), np.float32)
    return torch.from_numpy(noise), torch.from_numpy(timesteps), torch.from_numpy(dropped)


def _per_sample(values: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    return values[timesteps].view(-1, 1, 1, 1)


def add_noise(
    latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alpha_bar: torch.Tensor
) -> torch.Tensor:
    """x_t = sqrt(alpha-bar_t) x_0 + sqrt(1 - alpha-bar_t) noise."""
    a = _per_sample(alpha_bar, timesteps)
    return a.sqrt() * latents + (1 - a).sqrt() * noise


def velocity(
    latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alpha_bar: torch.Tensor
) -> torch.Tensor:
    """The v-prediction target: sqrt(alpha-bar_t) noise - sqrt(1 - alpha-bar_t) x_0."""
    a = _per_sample(alpha_bar, timesteps)
    return a.sqrt() * noise - (1 - a).sqrt() * latents


def min_snr_weights(
    timesteps: torch.Tensor,
    alpha_bar: torch.Tensor,
    gamma: float,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """Per-sample loss weights: min(SNR, gamma)/SNR for epsilon, min(SNR, gamma)/(SNR+1) for v.

    Both make the effective x0-space weight min(SNR, gamma): easy low-noise steps stop
    dominating the loss.
    """
    a = alpha_bar[timesteps]
    snr = a / (1 - a)
    divisor = snr + 1 if prediction_type == "v_prediction" else snr
    return snr.clamp(max=gamma) / divisor


def diffusion_loss(
    unet,
    latents_BCHW: torch.Tensor,
    text_emb: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    gamma: float,
    prediction_type: str,
    channels_last: bool = False,
) -> torch.Tensor:
    """Min-SNR-weighted MSE of the UNet's prediction, averaged over the batch."""
    alpha_bar = alphas_cumprod(latents_BCHW.device)
    noisy = add_noise(latents_BCHW, noise, timesteps, alpha_bar)
    if channels_last:
        noisy = noisy.contiguous(memory_format=torch.channels_last)
    if prediction_type == "v_prediction":
        target = velocity(latents_BCHW, noise, timesteps, alpha_bar)
    else:
        target = noise
    pred = unet(noisy, timesteps, text_emb).sample
    mse = F.mse_loss(pred.float(), target, reduction="none").mean(dim=(1, 2, 3))
    return (mse * min_snr_weights(timesteps, alpha_bar, gamma, prediction_type)).mean()
