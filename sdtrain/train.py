"""Train a UNet on a phase set (or a fine-tune's images): DDP, EMA, resumable checkpoints.

What a run trains on, its networks' structure and its loss come from its mode
(sdtrain/modes.py: a phase's min-SNR loss, sdtrain/finetune.py); this is the only loop.

Run as `torchrun --nproc_per_node=N -m sdtrain.train --config run.json`; a plain `python -m`
run is a group of one, same code path. DDP wraps the model here, never in model code. A run
resumes from `checkpoints/latest` at the exact next sample (of a bucketed set: the next global
batch), on the same phase set (its manifest's digest is part of the run's shape); only rank 0
writes files. Every optimizer step the ranks agree, in one all-reduce, on whether to stop (a
signal) and whether the step is non-finite (then skipped: no weight or EMA update).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

from catalog import load_catalog
from sdtrain.atomic import clean_temporaries, write_json_atomic
from sdtrain.bucket_batches import SMALL_BUCKET
from sdtrain.checkpoint import (
    CheckpointDir,
    CheckpointError,
    KeepPolicy,
    load_weights,
    read_ema_step,
    read_trainer_state,
    write_checkpoint,
)
from sdtrain.config import TrainConfig
from sdtrain.data import (
    BucketBatchSampler,
    EpochSampler,
    PhaseSet,
    collate,
    split_rows,
)
from sdtrain.ema import EMA
from sdtrain.finetune import mode_for
from sdtrain.models import build_text_encoder, build_vae
from sdtrain.monitor import Monitor, read_log
from sdtrain.objective import VALIDATION_STREAM, diffusion_loss, draw_noise
from sdtrain.runtime import (
    StopRequest,
    build_optimizer,
    choose_numerics,
    configure_backends,
    load_optimizer_state,
    prepare_steps,
    rng_state,
    set_rng_state,
    setup_distributed,
)
from sdtrain.sampling import encode_text
from sdtrain.schedules import build_lr_schedule, total_optimizer_steps


class TrainingInterrupted(Exception):
    """SIGTERM or Ctrl-C stopped the run after it checkpointed; rerunning resumes it."""


class TrainingDiverged(Exception):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


def manifest_digest(phase_dir: str | Path) -> str:
    """sha256 of the phase set's manifest: which samples, in which rows (part of a resume's
    identity: the same row count over other samples must not resume)."""
    with open(Path(phase_dir) / "manifest.parquet", "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def epoch_batches(
    loader: DataLoader,
    sampler: EpochSampler | BucketBatchSampler,
    *,
    start_epoch: int,
    start_done: int,
    num_epochs: int,
    done_per_batch: int,
) -> Iterator[tuple[int, int, list, float]]:
    """(epoch, the epoch's progress once this batch is consumed, batch, seconds waited for it).

    Progress is in the sampler's unit: samples of all ranks (`EpochSampler`, `done_per_batch`
    = batch_size x world_size), or global batches (`BucketBatchSampler`, 1).
    """
    for epoch in range(start_epoch, num_epochs):
        done = start_done if epoch == start_epoch else 0
        sampler.set_epoch(epoch, done)
        batches = iter(loader)
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            done += done_per_batch
            yield epoch, done, batch, time.perf_counter() - waited


def row_batches(dataset, rows: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """Positions in `rows` in batches whose latents stack: of one bucket each (a phase set)."""
    if isinstance(dataset, PhaseSet):
        yield from dataset.row_batches(rows, batch_size)
        return
    for start in range(0, len(rows), batch_size):
        yield np.arange(start, min(start + batch_size, len(rows)))


@torch.no_grad()
def validation_loss(
    unet, phase_set: PhaseSet, rows: np.ndarray, text_encoder, config: TrainConfig, autocast
) -> float:
    """The training loss at fixed noise and timesteps per row, no CFG drop, over all ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = next(unet.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, row count
    my_rows = rows[rank::world_size]
    for positions in row_batches(phase_set, my_rows, config.batch_size):
        items = [phase_set[int(i)] for i in my_rows[positions]]
        latents = torch.stack([latent for latent, _, _ in items]).to(device)
        input_ids = torch.stack([ids for _, ids, _ in items]).to(device)
        row_ids = torch.tensor([i for _, _, i in items])
        noise, timesteps, _ = draw_noise(
            row_ids,
            seed=config.seed,
            epoch=0,
            latent_shape=tuple(latents.shape[1:]),
            stream=VALIDATION_STREAM,
        )
        with autocast():
            loss = diffusion_loss(
                unet,
                latents,
                encode_text(text_encoder, input_ids),
                noise.to(device),
                timesteps.to(device),
                gamma=config.min_snr_gamma,
                prediction_type=config.prediction_type,
                channels_last=config.channels_last,
            )
        totals += torch.stack([loss.double() * len(items), torch.tensor(len(items), device=device)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def train(config: TrainConfig) -> dict | None:
    """Run (or resume) the phase; rank 0 returns the summary it wrote, other ranks None."""
    rank, world_size, device = setup_distributed()
    try:
        return _train(config, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def _train(config: TrainConfig, rank: int, world_size: int, device: torch.device) -> dict | None:
    started = time.perf_counter()
    configure_backends(deterministic=config.deterministic)
    if device.type == "cpu" and world_size > 1:
        torch.set_num_threads(1)  # ranks share the cores; each would otherwise take them all
    run_dir = Path(config.run_dir)
    model = load_catalog().model(config.model)
    mode = mode_for(config, model, device)  # what the run trains on, and its loss
    numerics = choose_numerics(device, config.precision)
    autocast = functools.partial(
        torch.autocast,
        device.type,
        numerics.autocast_dtype or torch.float32,
        enabled=numerics.autocast_dtype is not None,
    )
    checkpoints = CheckpointDir(
        run_dir / "checkpoints",
        KeepPolicy(checkpoint_every=config.checkpoint_every, keep_every=config.keep_every),
    )
    if rank == 0:
        clean_temporaries(run_dir)  # a killed run's half-built final/
        checkpoints.clean()
    dist.barrier()
    resume_from = checkpoints.resume_point() if config.resume else None
    state = read_trainer_state(resume_from, device) if resume_from else None  # checksums first

    # Data: validation rows held out by a seeded draw; the rest in a per-epoch seeded order.
    phase_set = mode.dataset()
    train_rows, val_rows = split_rows(len(phase_set), config.num_val_samples, config.seed)
    # Several buckets, flips, latent draws or train-time captions: batches of one bucket, items
    # (row, epoch) (`bucket_batches.uses_bucketed_sampler`).
    bucketed = isinstance(phase_set, PhaseSet) and phase_set.bucketed
    loading = dict(
        num_workers=config.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=config.num_workers > 0,
    )
    if bucketed:
        sampler = BucketBatchSampler(
            train_rows,
            phase_set.bucket_of_row[train_rows],
            phase_set.bucket_names,
            batch_size=config.batch_size,
            seed=config.seed,
            rank=rank,
            world_size=world_size,
        )
        loader = DataLoader(phase_set, batch_sampler=sampler, collate_fn=collate, **loading)
        left_out = sum(sampler.left_out.values())
        if left_out and rank == 0:
            print(
                f"left out {left_out} training rows under {SMALL_BUCKET} (buckets with fewer "
                f"than one global batch of {sampler.global_batch}): "
                + ", ".join(f"{b} ({n})" for b, n in sampler.left_out.items()),
                flush=True,
            )
    else:
        sampler = EpochSampler(len(train_rows), seed=config.seed, rank=rank, world_size=world_size)
        loader = DataLoader(
            Subset(phase_set, train_rows),  # an array: no Python int per row
            batch_size=config.batch_size,
            sampler=sampler,
            drop_last=True,  # equal micro-batches on every rank and every step
            **loading,
        )
    total_steps = total_optimizer_steps(
        len(loader), epochs=config.epochs, grad_accum=config.grad_accum, max_steps=config.max_steps
    )
    if total_steps == 0:
        small = f" ({sum(sampler.left_out.values())} in buckets too small)" if bucketed else ""
        raise ValueError(
            f"{config.phase_dir}: {len(train_rows)} training rows{small} give no optimizer step "
            f"at batch_size {config.batch_size} x {world_size} ranks x grad_accum "
            f"{config.grad_accum}"
        )
    global_batch = config.batch_size * world_size * config.grad_accum

    # Networks: the UNet from the checkpoint we resume, else the previous phase's final weights,
    # else its mode's init (random, or a fine-tune's base). Same seed on every rank; DDP also
    # broadcasts rank 0's weights.
    from diffusers.models.attention_processor import AttnProcessor2_0

    unet = mode.build_unet(resuming=resume_from is not None)
    weights_dir = resume_from or (Path(config.init_from) if config.init_from else None)
    if weights_dir:
        unet.load_state_dict(load_weights(weights_dir / "unet.safetensors"))
    unet.set_attn_processor(AttnProcessor2_0())  # SDPA: flash / memory-efficient kernels
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    memory_format = torch.channels_last if config.channels_last else torch.contiguous_format
    unet = unet.to(device, memory_format=memory_format).train()
    # The EMA's age before this run: a resumed run's own record, else the previous phase's.
    if state is not None:
        ema_age = state.get("ema_age", 0)
    elif config.init_from and config.ema_carry:
        ema_age = read_ema_step(Path(config.init_from))
    else:
        ema_age = 0
    ema = EMA(
        unet,
        decay=config.ema_decay,
        every=config.ema_every,
        device=torch.device("cpu") if config.ema_on_cpu else device,
        age=ema_age,
    )
    if weights_dir:
        ema.load_state_dict(load_weights(weights_dir / "unet_ema.safetensors"))
    # The frozen networks have fixed weights (seed 0 for the tiny twins, as the encode stage).
    text_encoder = build_text_encoder(model).to(device).eval().requires_grad_(False)
    text_encoder = mode.prepare_text_encoder(text_encoder, resume_from)
    # What DDP wraps: compiled for the steps, each batch shape run once first (runtime.py).
    data = (loader, phase_set, sampler if bucketed else None)
    module, warmed = prepare_steps(mode, unet, text_encoder, config, device, autocast, data, rank)
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )

    # Optimization: fresh for every phase; restored only when resuming this run.
    trained = mode.trainable_parameters(unet, text_encoder)
    optimizer = build_optimizer(
        trained,
        lr=config.lr,
        betas=config.adam_betas,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    lr_schedule = build_lr_schedule(
        optimizer,
        warmup_steps=config.warmup_steps,
        total_steps=total_steps,
        kind=config.lr_schedule,
    )
    scaler = torch.amp.GradScaler(device.type, enabled=numerics.grad_scaler)
    run_shape = {
        "total_steps": total_steps,
        "global_batch": global_batch,
        "num_train_rows": len(train_rows),
        "seed": config.seed,
        "prediction_type": config.prediction_type,
        "manifest_sha256": manifest_digest(config.phase_dir),
    }
    if bucketed:  # the same count is the same cut of the same buckets into global batches
        run_shape["batches_per_epoch"] = sampler.num_batches
    # The epoch's progress: samples (EpochSampler) or global batches (BucketBatchSampler).
    step, epoch, done, best_val_loss = 0, 0, 0, float("inf")
    num_nonfinite = 0
    if state is not None:
        for key, value in run_shape.items():
            if key not in state["run_shape"]:  # written before sdpipe recorded it
                continue
            if key == "manifest_sha256" and state["run_shape"][key] != value:
                raise CheckpointError(
                    f"{resume_from} was trained on another phase set: "
                    f"{Path(config.phase_dir) / 'manifest.parquet'} changed since (sha256 "
                    f"{state['run_shape'][key][:12]} -> {value[:12]}); restore that phase set "
                    "to resume, or delete the run's checkpoints/ to train the phase from the start"
                )
            if state["run_shape"][key] != value:
                raise CheckpointError(
                    f"{resume_from}: written by a run with {key}={state['run_shape'][key]!r}, "
                    f"this run has {value!r}; resume with the same settings or use a new run_dir"
                )
        load_optimizer_state(optimizer, state["optimizer"])
        lr_schedule.load_state_dict(state["lr_schedule"])
        scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"][rank if len(state["rng"]) == world_size else 0])
        was_bucketed = state.get("batches_done") is not None  # older checkpoints: never
        if was_bucketed != bucketed:
            orders = ("in the epoch sampler's order", "in batches of one bucket")
            raise CheckpointError(
                f"{resume_from}: written by a run that read its phase set "
                f"{orders[was_bucketed]}, this run reads it {orders[bucketed]} (flip_p, "
                "sample_latents, train_time_captions or the set's buckets changed); resume "
                "with the same settings or use a new run_dir"
            )
        step, epoch = state["step"], state["epoch"]
        done = state["batches_done"] if bucketed else state["samples_done"]
        best_val_loss = state["best_val_loss"]
        num_nonfinite = state.get("num_nonfinite", 0)
    resumed_from_step = step

    # Rank 0's extra: the VAE of the sample grids.
    vae = build_vae(model).to(device).eval().requires_grad_(False) if rank == 0 else None

    def sample_grid():
        """The mode's picture of the run (a phase's: the sample prompts) from the EMA weights."""
        with ema.swapped_into(unet):
            return mode.sample_grid(unet, vae, autocast)

    def save_checkpoint(*, is_best: bool, all_ranks: bool = True) -> None:
        """The resumable state after `step` (every rank's RNG unless one rank saves alone)."""
        rngs = [None] * world_size if rank == 0 else None
        if all_ranks:
            dist.gather_object(rng_state(), rngs, dst=0)
        else:
            rngs = [rng_state()]
        if rank != 0:
            return
        checkpoints.save(
            step,
            is_best=is_best,
            unet=unet.state_dict(),
            unet_ema=ema.state_dict(),
            config=config,
            ema_step=ema.age + step,
            extra=mode.extra_weights(text_encoder),
            trainer={
                "step": step,
                "epoch": epoch,
                "samples_done": None if bucketed else done,
                "batches_done": done if bucketed else None,
                "best_val_loss": best_val_loss,
                "optimizer": optimizer.state_dict(),
                "lr_schedule": lr_schedule.state_dict(),
                "scaler": scaler.state_dict(),
                "rng": rngs,
                "run_shape": run_shape,
                "ema_age": ema.age,
                "num_nonfinite": num_nonfinite,
            },
        )

    monitor = Monitor(config, start_step=step, enabled=rank == 0)
    stop = StopRequest()
    window_loss = torch.zeros((), device=device)  # summed over the steps since the last log
    step_loss = torch.zeros((), device=device)  # this rank's loss of the step in progress
    window_steps, window_wait, window_start = 0, 0.0, time.perf_counter()
    window_finite, nonfinite_in_a_row = 0, 0
    window_rows: list[torch.Tensor] = []  # rank 0's rows since the last log: the data order
    total_wait, loop_start = 0.0, time.perf_counter()
    saved_step, consistent = step, True
    micro_step = 0
    batches = epoch_batches(
        loader,
        sampler,
        start_epoch=epoch,
        start_done=done,
        num_epochs=config.epochs,
        done_per_batch=1 if bucketed else config.batch_size * world_size,
    )
    with stop.installed():
        try:
            for batch_epoch, batch_done, batch, waited in batches:
                if step == total_steps:
                    break
                window_wait += waited
                window_rows.append(batch[-1])  # a batch's last item: its rows
                micro_step += 1
                steps_now = micro_step % config.grad_accum == 0
                # Gradients are all-reduced only on the micro-batch that steps the optimizer.
                with contextlib.nullcontext() if steps_now else ddp.no_sync():
                    with autocast():
                        loss = mode.loss(ddp, batch, epoch=batch_epoch)
                    scaler.scale(loss / config.grad_accum).backward()
                step_loss += loss.detach() / config.grad_accum
                if not steps_now:
                    continue

                consistent = False  # weights, optimizer and EMA disagree until the EMA update
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(trained, config.max_grad_norm)
                lr = lr_schedule.get_last_lr()[0]
                # One all-reduce per step: was any rank told to stop, is any rank's loss or the
                # (all-reduced, so common) gradient norm NaN/inf. Under fp16 the GradScaler
                # owns infinite gradients: it skips those steps and lowers its scale.
                checks = torch.stack(
                    [
                        torch.tensor(float(stop.requested), device=device),
                        (~torch.isfinite(step_loss)).float(),
                        (~torch.isfinite(grad_norm)).float() * (not numerics.grad_scaler),
                    ]
                )
                dist.all_reduce(checks)
                stopping, nonfinite = bool(checks[0] > 0), bool(checks[1:].sum() > 0)
                if nonfinite:  # no update of the weights, the optimizer moments or the EMA
                    num_nonfinite += 1
                    nonfinite_in_a_row += 1
                    if numerics.grad_scaler:
                        scaler.update()
                    print(
                        f"step {step + 1}: non-finite loss or gradient norm, skipped "
                        f"({nonfinite_in_a_row} in a row, {num_nonfinite} in all)",
                        flush=True,
                    )
                else:
                    scaler.step(optimizer)
                    scaler.update()
                    nonfinite_in_a_row = 0
                    window_loss += step_loss
                    window_finite += 1
                lr_schedule.step()
                optimizer.zero_grad(set_to_none=True)
                step_loss.zero_()
                step += 1
                if not nonfinite and ema.due(step):
                    ema.update(unet, step)
                epoch, done = batch_epoch, batch_done
                consistent = True
                window_steps += 1
                if nonfinite_in_a_row >= config.max_nonfinite_steps:
                    raise TrainingDiverged(
                        f"{nonfinite_in_a_row} optimizer steps in a row had a non-finite loss "
                        f"or gradient norm, the last at step {step}/{total_steps}: stopped. The "
                        f"weights were not updated by them; the last checkpoint is "
                        f"{checkpoints.latest() or 'none'}. Lower the learning rate (or check "
                        "the phase set's latents) and rerun to resume from it"
                    )

                if step % config.log_every == 0 or step == total_steps or stopping:
                    reduced = window_loss.clone()
                    dist.all_reduce(reduced)
                    now = time.perf_counter()
                    monitor.step(
                        step,
                        total_steps,
                        {
                            "loss": reduced.item() / (window_finite * world_size)
                            if window_finite
                            else float("nan"),
                            "lr": lr,
                            "grad_norm": grad_norm.item(),
                            "samples_per_s": window_steps * global_batch / (now - window_start),
                            "data_wait": window_wait / (now - window_start),
                            "nonfinite_steps": window_steps - window_finite,
                        },
                        rows_crc=zlib.crc32(torch.cat(window_rows).numpy().tobytes()),
                    )
                    total_wait += window_wait
                    window_loss.zero_()
                    window_steps, window_wait, window_start = 0, 0.0, now
                    window_finite = 0
                    window_rows.clear()
                if stopping:  # what a resume needs, first: nothing else fits the grace period
                    save_checkpoint(is_best=False)
                    raise TrainingInterrupted(
                        f"stopped by a signal at step {step}/{total_steps}; checkpoint "
                        f"{checkpoints.step_dir(step)}; rerun to resume"
                    )

                is_best = False
                validate_now = step == total_steps or (
                    config.validate_every > 0 and step % config.validate_every == 0
                )
                if len(val_rows) and validate_now:
                    with ema.swapped_into(unet):
                        val_loss = validation_loss(
                            unet, phase_set, val_rows, text_encoder, config, autocast
                        )
                    is_best = val_loss < best_val_loss
                    best_val_loss = min(best_val_loss, val_loss)
                    monitor.validation(step, val_loss, is_best=is_best)
                if checkpoints.policy.due(step, total_steps) or is_best:
                    save_checkpoint(is_best=is_best)
                    saved_step = step
                grid_due = config.sample_every > 0 and step % config.sample_every == 0
                if rank == 0 and grid_due and step != total_steps:  # the last: samples/final.png
                    monitor.grid(step, sample_grid(), run_dir / "samples" / f"step-{step:06d}.png")
        except (TrainingInterrupted, TrainingDiverged):
            monitor.close()
            raise
        except BaseException:
            # The state of the last finished step, unless the failure hit mid-update. Rank 0
            # alone: the other ranks may be gone, so no collective.
            if rank == 0 and consistent and step > saved_step:
                print(f"saving the state of step {step} before failing", flush=True)
                save_checkpoint(is_best=False, all_ranks=False)
            monitor.close()
            raise
    train_seconds = time.perf_counter() - loop_start

    summary = None
    if rank == 0:
        final = write_checkpoint(
            run_dir / "final",
            unet=unet.state_dict(),
            unet_ema=ema.state_dict(),
            config=config,
            ema_step=ema.age + step,
            extra=mode.extra_weights(text_encoder),
        )
        grid_path = run_dir / "samples" / "final.png"
        monitor.grid(step, sample_grid(), grid_path)
        monitor.close()
        logged = [r for r in read_log(run_dir / "log.jsonl") if "loss" in r]
        steps_run = step - resumed_from_step
        summary = {
            "phase": config.phase,
            "steps": step,
            "total_steps": total_steps,
            "resumed_from_step": resumed_from_step,
            "first_loss": logged[0]["loss"] if logged else float("nan"),
            "last_loss": logged[-1]["loss"] if logged else float("nan"),
            "best_val_loss": best_val_loss if len(val_rows) else None,
            "samples_per_s": steps_run * global_batch / train_seconds if steps_run else 0.0,
            "data_wait_fraction": total_wait / train_seconds if steps_run else 0.0,
            "nonfinite_steps": num_nonfinite,
            "world_size": world_size,
            "checkpoint": str(final),
            "best_checkpoint": str(checkpoints.best()) if checkpoints.best() else None,
            "sample_grid": str(grid_path),
            "seconds": round(time.perf_counter() - started, 3),
            "warm_up": warmed,
        }
        if bucketed:  # training rows per bucket, those left out by reason, those sitting out
            summary["buckets"] = sampler.buckets
            summary["left_out"] = {SMALL_BUCKET: sum(sampler.left_out.values())}
            summary["small_buckets"] = sampler.left_out
            summary["leftover_per_epoch"] = sampler.leftover_per_epoch
        write_json_atomic(run_dir / "summary.json", summary)
    return summary


@record  # torchrun's failure report then carries the rank's traceback, not "<N/A>"
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train one phase (run under torchrun).")
    parser.add_argument("--config", required=True, help="a TrainConfig JSON file")
    args = parser.parse_args(argv)
    try:
        train(TrainConfig.from_json(args.config))
    except TrainingInterrupted as e:
        print(str(e), flush=True)
        sys.exit(143)
    except TrainingDiverged as e:
        print(f"error: {e}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
