"""Validation loss per held-out row at the trainer's fixed noise and timesteps, by timestep band.

Rows get the noise and timestep the trainer's validation draws for them (seeded by row), so any
weights see the same problems. The MSE is reported unweighted, so phases trained with other
min-SNR gammas compare; weighted by min-SNR, its mean is the trainer's `val_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sdtrain.data import PhaseSet
from sdtrain.objective import (
    NOISE_SCHEDULE,
    VALIDATION_STREAM,
    add_noise,
    alphas_cumprod,
    draw_noise,
    min_snr_weights,
    velocity,
)
from sdtrain.sampling import encode_text

# Timestep bands, [start, stop): low t is fine detail, high t is composition.
_T = NOISE_SCHEDULE["num_train_timesteps"]
BANDS = {"low": (0, _T // 3), "mid": (_T // 3, 2 * _T // 3), "high": (2 * _T // 3, _T)}


@dataclass(frozen=True, slots=True)
class RowLosses:
    rows: np.ndarray  # int64 [N] phase-set rows
    timesteps: np.ndarray  # int64 [N]
    mse: np.ndarray  # float64 [N]: the prediction target's MSE, unweighted
    weight: np.ndarray  # float64 [N]: the min-SNR weight the trainer multiplies it by

    def trainer_loss(self) -> float:
        """The trainer's validation loss of these rows (its min-SNR-weighted mean)."""
        return float((self.mse * self.weight).mean())

    def by_band(self) -> dict[str, float | None]:
        """Mean unweighted MSE per band (None for a band without rows) and over all rows."""
        out: dict[str, float | None] = {}
        for name, (lo, hi) in BANDS.items():
            inside = (self.timesteps >= lo) & (self.timesteps < hi)
            out[name] = float(self.mse[inside].mean()) if inside.any() else None
        out["all"] = float(self.mse.mean()) if len(self.mse) else None
        return out


@torch.no_grad()
def row_losses(
    unet,
    text_encoder,
    phase_set: PhaseSet,
    rows: np.ndarray,
    *,
    seed: int,
    gamma: float,
    prediction_type: str,
    batch_size: int = 16,
) -> RowLosses:
    """The losses of `rows` as the trainer's validation computes them, one row each (batched
    by bucket: latents of several shapes do not stack)."""
    device = next(unet.parameters()).device
    alpha_bar = alphas_cumprod(device)
    rows = np.asarray(rows)
    timesteps_out = np.zeros(len(rows), np.int64)
    mse_out = np.zeros(len(rows), np.float64)
    for positions in phase_set.row_batches(rows, batch_size):
        items = [phase_set[int(i)] for i in rows[positions]]
        latents = torch.stack([latent for latent, _, _ in items]).to(device)
        input_ids = torch.stack([ids for _, ids, _ in items]).to(device)
        noise, timesteps, _ = draw_noise(
            torch.tensor([i for _, _, i in items]),
            seed=seed,
            epoch=0,
            latent_shape=tuple(latents.shape[1:]),
            stream=VALIDATION_STREAM,
        )
        noise, timesteps = noise.to(device), timesteps.to(device)
        noisy = add_noise(latents, noise, timesteps, alpha_bar)
        if prediction_type == "v_prediction":
            target = velocity(latents, noise, timesteps, alpha_bar)
        else:
            target = noise
        pred = unet(noisy, timesteps, encode_text(text_encoder, input_ids)).sample
        mse = F.mse_loss(pred.float(), target, reduction="none").mean(dim=(1, 2, 3))
        timesteps_out[positions] = timesteps.cpu().numpy()
        mse_out[positions] = mse.double().cpu().numpy()
    weight = min_snr_weights(
        torch.from_numpy(timesteps_out).to(device), alpha_bar, gamma, prediction_type
    )
    return RowLosses(
        rows=rows.astype(np.int64),
        timesteps=timesteps_out,
        mse=mse_out,
        weight=weight.double().cpu().numpy(),
    )
