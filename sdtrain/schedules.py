"""Schedules as small named functions: run length, learning rate, EMA decay.

The run length comes from the data loader's per-rank batch count, never the dataset length:
with DDP each rank sees 1/world_size of the rows, and a schedule sized on the dataset would
end its cosine world_size x too late (the recipe's bug #1).
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
)

MIN_LR_RATIO = 1e-2  # the warmup starts at, and the cosine ends at, lr x this


def total_optimizer_steps(
    num_batches_per_epoch: int, *, epochs: int, grad_accum: int, max_steps: int | None
) -> int:
    """Optimizer steps of a run: its loader's batches per epoch x epochs / grad_accum."""
    total = num_batches_per_epoch * epochs // grad_accum
    return total if max_steps is None else min(total, max_steps)


def build_lr_schedule(
    optimizer: Optimizer, *, warmup_steps: int, total_steps: int, kind: str = "cosine"
) -> LRScheduler:
    """Linear warmup from lr x 1e-2, then cosine down to lr x 1e-2 at `total_steps`; or, for
    `constant` (fine-tunes, as DreamBooth trains), the warmup and then lr throughout."""
    if kind == "constant":
        after = ConstantLR(optimizer, factor=1.0, total_iters=0)
    else:
        eta_min = optimizer.param_groups[0]["lr"] * MIN_LR_RATIO
        after = CosineAnnealingLR(
            optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=eta_min
        )
    if warmup_steps == 0:
        return after
    warmup = LinearLR(optimizer, start_factor=MIN_LR_RATIO, total_iters=warmup_steps)
    return SequentialLR(optimizer, [warmup, after], milestones=[warmup_steps])


def ema_decay(step: int, *, decay: float = 0.9999, every: int = 1) -> float:
    """The decay of an EMA update made after optimizer step `step` (1-based), every `every` steps.

    Per step the decay warms up as min(decay, (1 + s) / (10 + s)) at 0-based step s, so the EMA
    tracks a fresh model closely; an update that covers `every` steps applies their product,
    which keeps the EMA's horizon in steps whatever the update interval.
    """
    return math.prod(min(decay, (1 + s) / (10 + s)) for s in range(step - every, step))
