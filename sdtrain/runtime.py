"""The process around the loop: process group, numerics, optimizer, RNG state, stop signals.

SIGTERM and the first Ctrl-C only set a flag; the loop acts on it at a step boundary that all
ranks agree on, saves a checkpoint and exits. Acting inside the handler could save weights
half-way through an optimizer update.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device) of this process, with the default process group set up."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:  # not under torchrun: a group of one, held in an in-process store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


@dataclass(frozen=True, slots=True)
class Numerics:
    autocast_dtype: torch.dtype | None  # None: plain fp32
    grad_scaler: bool  # fp16 needs loss scaling; bf16 has fp32's exponent range and does not


def choose_numerics(device: torch.device, precision: str) -> Numerics:
    """bf16 autocast where the GPU supports it, else fp16 + GradScaler; fp32 on the CPU."""
    if precision == "auto":
        if device.type != "cuda":
            precision = "fp32"
        else:
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {
        "fp32": Numerics(autocast_dtype=None, grad_scaler=False),
        "bf16": Numerics(autocast_dtype=torch.bfloat16, grad_scaler=False),
        "fp16": Numerics(autocast_dtype=torch.float16, grad_scaler=True),
    }[precision]


def configure_backends(*, deterministic: bool) -> None:
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.optim.AdamW:
    """Fused AdamW (one kernel for all parameters), or the foreach one where fused is missing."""
    params = list(params)
    kwargs = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, foreach=True, **kwargs)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`, each moment then laid out as its parameter is.

    A checkpoint stores its tensors contiguous, and fused AdamW needs a parameter's moments in
    its layout: beside a channels_last parameter, the CPU kernel walks them as flat memory and
    updates each weight with other elements' moments; the CUDA one (torch 2.11, H100) refuses
    the step ("must have same dtype, device, and layout").
    """
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            moments = optimizer.state.get(p, {})
            for name, value in moments.items():
                moment = torch.is_tensor(value) and value.shape == p.shape  # not the step count
                if moment and value.stride() != p.stride():
                    moments[name] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


class StopRequest:
    """Set by SIGTERM or a first Ctrl-C while installed; a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        def request(signum, frame):
            if self.requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.requested = True
            self.signal_name = signal.Signals(signum).name
            print(f"{self.signal_name}: checkpointing at the next step, then stopping", flush=True)

        previous = {s: signal.signal(s, request) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
