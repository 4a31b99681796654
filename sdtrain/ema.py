"""An fp32 exponential moving average of a model's weights, on the GPU or in host RAM.

The shadow is a list of tensors, not a second module: validation and sampling swap it into
the training module for the duration of a `with ema.swapped_into(unet):` block, so an EMA kept
on the CPU costs no GPU memory. Updates run every N optimizer steps (seed 002). `age` counts the
optimizer steps the shadow already averaged before this run (a previous phase's EMA carried
on): the decay warmup is a function of the EMA's age, not of the run's step, so a phase that
starts from another's EMA does not erase it in its first hundred steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from sdtrain.schedules import ema_decay


class EMA:
    def __init__(
        self,
        module: torch.nn.Module,
        *,
        decay: float,
        every: int,
        device: torch.device,
        age: int = 0,
    ) -> None:
        self.decay = decay
        self.every = every
        self.age = age
        self.device = torch.device(device)
        self.names = [name for name, _ in module.named_parameters()]
        self.shadow = [
            p.detach().to(self.device, torch.float32, copy=True) for p in module.parameters()
        ]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module, step: int) -> None:
        """Move the shadow towards `module`'s weights after optimizer step `step` (1-based)."""
        live = [p.detach().to(self.device, torch.float32) for p in module.parameters()]
        weight = 1.0 - ema_decay(self.age + step, decay=self.decay, every=self.every)
        torch._foreach_lerp_(self.shadow, live, weight)

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        for p, s in zip(module.parameters(), self.shadow, strict=True):
            p.copy_(s)

    @contextlib.contextmanager
    def swapped_into(self, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """`module` holding the EMA weights inside the block, its own weights again after."""
        backup = [p.detach().to("cpu", copy=True) for p in module.parameters()]
        self.copy_to(module)
        try:
            yield module
        finally:
            with torch.no_grad():
                for p, b in zip(module.parameters(), backup, strict=True):
                    p.copy_(b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow, strict=True))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.names) - set(state)
        if missing:
            raise KeyError(f"EMA weights lack {len(missing)} parameters, e.g. {min(missing)}")
        for name, s in zip(self.names, self.shadow, strict=True):
            s.copy_(state[name])
