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
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from sdtrain.bucket_batches import shape_batches, warm_up_batches


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


def allow_recompiles(count: int) -> None:
    """Room for `count` compiled graphs per function (one per input shape) before torch falls
    back to eager; never lowers what was set before."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), count))


def compiled(module: torch.nn.Module, *, shapes: int) -> torch.nn.Module:
    """`module` compiled for `shapes` batch shapes: one static graph each (minutes each for
    SD1.5: one graph over symbolic shapes failed to compile the tiny UNet, torch 2.14), with room
    for all of them before torch would fall back to eager."""
    allow_recompiles(shapes + 8)
    return torch.compile(module, dynamic=False)


def warm_up(
    loss_of: Callable[[object], torch.Tensor],
    batches: Iterable,
    params: Iterable[torch.nn.Parameter],
) -> tuple[int, float]:
    """Forward and backward of one batch of each shape the run will see, before step 1, so that
    cuDNN's autotuning (benchmark mode) and torch.compile's graphs are paid here and not in the
    first steps of each bucket. The gradients are dropped and nothing else changes: no optimizer
    or EMA exists yet, and the loss draws its noise per (seed, epoch, row), not from a global
    generator. Returns (batches run, seconds)."""
    started, count = time.perf_counter(), 0
    for batch in batches:
        loss_of(batch).backward()
        count += 1
    for p in params:
        p.grad = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return count, time.perf_counter() - started


def prepare_steps(
    mode, unet, text_encoder, config, device: torch.device, autocast, data: tuple, rank: int
) -> tuple[torch.nn.Module, dict]:
    """The module the training steps run (what DDP wraps, `mode.ddp_module`): compiled when
    `config.compile` (it shares the weights: validation, sample grids and checkpoints use the
    UNet itself), and every batch shape the loader will give run once through the mode's loss
    (`warm_up`, on a GPU or when compiling; `config.warm_up` decides when set), so compiling and
    cuDNN's autotuning are not paid inside the first steps of each bucket. `data`: (loader,
    phase set, its bucketed sampler or None). Returns (module, its record: compile, shapes
    warmed, seconds)."""
    loader, phase_set, sampler = data
    module = mode.ddp_module(unet, text_encoder)
    rows = None if sampler is None else shape_batches(phase_set, sampler)  # the epoch's plan
    shapes = 1 if rows is None else len(rows)
    on = config.compile
    if on:
        module = compiled(module, shapes=shapes)
    record = {"compile": on, "shapes": 0, "seconds": 0.0}
    if config.warm_up if config.warm_up is not None else (device.type == "cuda" or on):

        def loss_of(batch):
            with autocast():
                return mode.loss(module, batch, epoch=0)

        batches = warm_up_batches(loader, phase_set, sampler, shapes=rows)
        ran, seconds = warm_up(loss_of, batches, [*unet.parameters(), *text_encoder.parameters()])
        record.update(shapes=ran, seconds=round(seconds, 3))
        if rank == 0:
            print(f"warm-up: {ran} batch shapes in {seconds:.1f} s (compile {on})", flush=True)
    return module, record
