"""Train a UNet on a phase set: epsilon prediction with min-SNR weighting, DDP, EMA weights.

Run as `torchrun --nproc_per_node=N -m sdtrain.train --config run.json`; a plain `python -m`
run is a process group of one, so both take the same code path. The schedule's length comes
from the loader's per-rank batch count, not the dataset length: it must match the steps taken.
Only rank 0 writes, each file through a temporary renamed into place.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler
from safetensors.torch import load_file, save_file
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR
from torch.utils.data import DataLoader

from catalog import load_catalog
from sdtrain.config import TrainConfig
from sdtrain.data import EpochSampler, PhaseSet
from sdtrain.models import build_text_encoder, build_unet, build_vae, tokenize
from sdtrain.sampling import NOISE_SCHEDULE, decode_images, image_grid, sample_latents
from tasks.shards import TMP_MARK, atomic_path, clean_temporaries, write_json_atomic

MIN_LR_RATIO = 1e-2  # the warmup starts at, and the cosine ends at, lr x this


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


def total_optimizer_steps(
    num_batches_per_epoch: int, *, epochs: int, grad_accum: int, max_steps: int | None
) -> int:
    total = num_batches_per_epoch * epochs // grad_accum
    return total if max_steps is None else min(total, max_steps)


def build_lr_schedule(optimizer, *, warmup_steps: int, total_steps: int) -> LRScheduler:
    """Linear warmup from lr x 1e-2, then cosine down to lr x 1e-2 at `total_steps`."""
    eta_min = optimizer.param_groups[0]["lr"] * MIN_LR_RATIO
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=eta_min)
    if warmup_steps == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=MIN_LR_RATIO, total_iters=warmup_steps)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])


def min_snr_weights(
    timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, gamma: float
) -> torch.Tensor:
    """min(SNR, gamma) / SNR per sample: easy low-noise steps stop dominating the loss."""
    alpha_bar = alphas_cumprod[timesteps]
    snr = alpha_bar / (1 - alpha_bar)
    return snr.clamp(max=gamma) / snr


def ema_decay(step: int) -> float:
    """Decay at 0-based optimizer step `step`: short memory early, so EMA tracks a fresh model."""
    return min(0.9999, (1 + step) / (10 + step))


def encode_text(text_encoder, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return text_encoder(input_ids).last_hidden_state


def diffusion_loss(
    unet, latents_BCHW: torch.Tensor, text_emb: torch.Tensor, noise_scheduler, gamma: float
) -> torch.Tensor:
    """Min-SNR-weighted epsilon MSE at uniform random timesteps, averaged over the batch."""
    noise = torch.randn_like(latents_BCHW)
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(latents_BCHW.device)
    timesteps = torch.randint(
        0, len(alphas_cumprod), (len(latents_BCHW),), device=latents_BCHW.device
    )
    noisy = noise_scheduler.add_noise(latents_BCHW, noise, timesteps)
    pred = unet(noisy, timesteps, text_emb).sample
    mse = F.mse_loss(pred.float(), noise, reduction="none").mean(dim=(1, 2, 3))
    return (mse * min_snr_weights(timesteps, alphas_cumprod, gamma)).mean()


def epochs_of(loader: DataLoader, sampler: EpochSampler, num_epochs: int) -> Iterator:
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        yield from loader


def save_final(run_dir: Path, unet, ema_unet) -> Path:
    """`<run_dir>/final/` with unet.safetensors and unet_ema.safetensors, renamed in whole."""
    final = run_dir / "final"
    tmp_dir = run_dir / f".final{TMP_MARK}{os.getpid()}"
    tmp_dir.mkdir(parents=True)
    for name, module in (("unet", unet), ("unet_ema", ema_unet)):
        state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        with atomic_path(tmp_dir / f"{name}.safetensors") as tmp:
            save_file(state, str(tmp))
    if final.exists():  # a rerun of the phase replaces its previous weights
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    return final


def train(config: TrainConfig) -> dict | None:
    """Run the phase; rank 0 returns the summary it wrote, other ranks None."""
    started = time.perf_counter()
    rank, world_size, device = setup_distributed()
    if device.type == "cpu" and world_size > 1:
        torch.set_num_threads(1)  # ranks share the cores; each would otherwise take them all
    run_dir = Path(config.run_dir)
    model = load_catalog().model(config.model)
    use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    amp = functools.partial(torch.autocast, device.type, torch.bfloat16, enabled=use_bf16)

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    unet = build_unet(model, seed=config.seed).to(device).train()
    if config.init_from:
        unet.load_state_dict(load_file(Path(config.init_from) / "unet.safetensors"))
    ema_unet = copy.deepcopy(unet).requires_grad_(False).eval()
    if config.init_from:
        ema_unet.load_state_dict(load_file(Path(config.init_from) / "unet_ema.safetensors"))
    text_encoder = build_text_encoder(model, seed=config.seed).to(device).requires_grad_(False)
    text_encoder.eval()
    empty_emb = encode_text(text_encoder, tokenize([""]).to(device))
    vae = build_vae(model, seed=config.seed).to(device).eval() if rank == 0 else None
    prompt_emb = encode_text(text_encoder, tokenize(list(config.sample_prompts)).to(device))
    ddp = DistributedDataParallel(
        unet,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )

    dataset = PhaseSet(config.phase_dir)
    sampler = EpochSampler(len(dataset), seed=config.seed, rank=rank, world_size=world_size)
    loader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        sampler=sampler,
        drop_last=True,  # equal micro-batches on every rank and every step
        num_workers=config.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=config.num_workers > 0,
    )
    total_steps = total_optimizer_steps(
        len(loader), epochs=config.epochs, grad_accum=config.grad_accum, max_steps=config.max_steps
    )
    if total_steps == 0:
        raise ValueError(
            f"{config.phase_dir}: {len(dataset)} rows give no optimizer step at batch_size "
            f"{config.batch_size} x {world_size} ranks x grad_accum {config.grad_accum}"
        )
    optimizer = torch.optim.AdamW(unet.parameters(), lr=config.lr, fused=device.type == "cuda")
    lr_schedule = build_lr_schedule(
        optimizer, warmup_steps=config.warmup_steps, total_steps=total_steps
    )
    noise_scheduler = DDPMScheduler(**NOISE_SCHEDULE)
    ema_params, live_params = list(ema_unet.parameters()), list(unet.parameters())
    latent_side = model.resolution // 8
    samples_per_step = config.batch_size * world_size * config.grad_accum

    def write_samples(path: Path) -> Path:
        with amp():
            latents = sample_latents(
                ema_unet,
                prompt_emb,
                empty_emb,
                latent_shape=(unet.config.in_channels, latent_side, latent_side),
                num_steps=config.sample_steps,
                guidance_scale=config.guidance_scale,
                seed=config.seed,
            )
        with atomic_path(path) as tmp:
            image_grid(decode_images(vae, latents, model.scaling_factor)).save(tmp, format="PNG")
        return path

    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        clean_temporaries(run_dir)  # a killed run's half-built final/
        writer = SummaryWriter(str(run_dir / "tensorboard"))

    torch.manual_seed(config.seed + rank)  # noise, timesteps and cfg dropout differ per rank
    step, step_loss = 0, torch.zeros((), device=device)
    first_loss = last_loss = float("nan")
    loop_started = last_log_time = time.perf_counter()
    last_log_step = 0
    for micro_step, (latents, input_ids) in enumerate(
        epochs_of(loader, sampler, config.epochs), start=1
    ):
        latents = latents.to(device, non_blocking=True)
        input_ids = input_ids.to(device, non_blocking=True)
        steps_now = micro_step % config.grad_accum == 0
        # Gradients are all-reduced only on the micro-batch that steps the optimizer.
        with contextlib.nullcontext() if steps_now else ddp.no_sync():
            with amp():
                text_emb = encode_text(text_encoder, input_ids)
                dropped = torch.rand(len(text_emb), device=device) < config.cfg_dropout
                text_emb = torch.where(dropped[:, None, None], empty_emb, text_emb)
                loss = diffusion_loss(ddp, latents, text_emb, noise_scheduler, config.min_snr_gamma)
            (loss / config.grad_accum).backward()
        step_loss += loss.detach() / config.grad_accum
        if not steps_now:
            continue

        grad_norm = torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        lr = lr_schedule.get_last_lr()[0]
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, live_params, 1.0 - ema_decay(step))
        step += 1

        dist.all_reduce(step_loss)  # gloo has no AVG: sum, then divide
        step_loss /= world_size
        if step == 1:
            first_loss = step_loss.item()
        if step % config.log_every == 0 or step == total_steps:
            last_loss, now = step_loss.item(), time.perf_counter()
            samples_per_s = (step - last_log_step) * samples_per_step / (now - last_log_time)
            last_log_time, last_log_step = now, step
            if rank == 0:
                print(f"step {step}/{total_steps} loss={last_loss:.4f} lr={lr:.2e}", flush=True)
                for name, value in (
                    ("loss", last_loss),
                    ("lr", lr),
                    ("grad_norm", grad_norm.item()),
                    ("samples_per_s", samples_per_s),
                ):
                    writer.add_scalar(name, value, step)
                with open(run_dir / "log.jsonl", "a") as log:
                    log.write(json.dumps({"step": step, "loss": last_loss, "lr": lr}) + "\n")
        step_loss.zero_()
        if step == total_steps:
            break  # the last step's grid is samples/final.png
        if rank == 0 and config.sample_every and step % config.sample_every == 0:
            write_samples(run_dir / "samples" / f"step-{step:06d}.png")
    train_seconds = time.perf_counter() - loop_started

    summary = None
    if rank == 0:
        writer.close()
        checkpoint = save_final(run_dir, unet, ema_unet)
        sample_grid = write_samples(run_dir / "samples" / "final.png")
        summary = {
            "phase": config.phase,
            "steps": step,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "samples_per_s": step * samples_per_step / train_seconds,
            "world_size": world_size,
            "checkpoint": str(checkpoint),
            "sample_grid": str(sample_grid),
            "seconds": round(time.perf_counter() - started, 3),
        }
        write_json_atomic(run_dir / "summary.json", summary)
    dist.destroy_process_group()
    return summary


@record  # torchrun's failure report then carries the rank's traceback, not "<N/A>"
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train one phase (run under torchrun).")
    parser.add_argument("--config", required=True, help="a TrainConfig JSON file")
    args = parser.parse_args(argv)
    train(TrainConfig.from_json(args.config))


if __name__ == "__main__":
    main()
