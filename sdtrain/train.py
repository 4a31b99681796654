"""Train a UNet on a phase set (or a fine-tune's images): DDP, EMA, resumable checkpoints.

Run as `torchrun --nproc_per_node=N -m sdtrain.train --config run.json`; a plain `python -m`
run is a group of one, same code path. DDP wraps the model here, never in model code. What a
run trains on, its networks' structure and its loss come from its mode (sdtrain/modes.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from catalog import load_catalog
from sdtrain.atomic import clean_temporaries, write_json_atomic
from sdtrain.bucket_batches import SMALL_BUCKET
from sdtrain.checkpoint import (
    CheckpointDir,
    KeepPolicy,
    check_resumable,
    load_weights,
    read_ema_step,
    read_trainer_state,
    write_checkpoint,
)
from sdtrain.config import TrainConfig
from sdtrain.data import PhaseSet
from sdtrain.ema import EMA
from sdtrain.finetune import mode_for
from sdtrain.lineage import RunLineage
from sdtrain.models import build_text_encoder, build_vae
from sdtrain.monitor import LogWindow, Monitor, read_log
from sdtrain.objective import VALIDATION_STREAM, diffusion_loss, draw_noise
from sdtrain.run_data import row_batches, run_data
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
from sdtrain.schedules import build_lr_schedule


class TrainingInterrupted(Exception):
    """SIGTERM or Ctrl-C stopped the run after it checkpointed; rerunning resumes it."""


class TrainingDiverged(Exception):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


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


@dataclass(kw_only=True, slots=True)
class Progress:
    """Where the run stands, as its checkpoints record it."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    done: int = 0  # the epoch's progress: samples of all ranks, or global batches (run_data.py)
    best_val_loss: float = float("inf")
    num_nonfinite: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm


class Trainer:
    """One rank's run. `__init__` sets it up part by part (its data, networks, optimization and
    the state it resumes), `fit` is the loop, `run` drives it and writes the final weights.

    The loop's parts: `forward_backward_step` (a micro-batch), `train_step` (the optimizer step
    the ranks agree on in one all-reduce: stop on a signal, skip a non-finite step), `log`,
    `stop`, `validate`, `save_checkpoint`. A run resumes from `checkpoints/latest` at the exact
    next sample (of a bucketed set: the next global batch), on the same phase set (its
    manifest's digest is part of the run's shape); only rank 0 writes files.
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int, device: torch.device):
        self.started = time.perf_counter()
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        configure_backends(deterministic=config.deterministic)
        if device.type == "cpu" and world_size > 1:
            torch.set_num_threads(1)  # ranks share the cores; each would otherwise take them all
        self.run_dir = Path(config.run_dir)
        self.model = load_catalog().model(config.model)
        self.mode = mode_for(config, self.model, device)  # what the run trains on, and its loss
        self.numerics = choose_numerics(device, config.precision)
        self.autocast = functools.partial(
            torch.autocast,
            device.type,
            self.numerics.autocast_dtype or torch.float32,
            enabled=self.numerics.autocast_dtype is not None,
        )
        self.checkpoints = CheckpointDir(
            self.run_dir / "checkpoints",
            KeepPolicy(checkpoint_every=config.checkpoint_every, keep_every=config.keep_every),
        )
        if rank == 0:
            clean_temporaries(self.run_dir)  # a killed run's half-built final/
            self.checkpoints.clean()
        dist.barrier()
        self.resume_from = self.checkpoints.resume_point() if config.resume else None
        state = read_trainer_state(self.resume_from, device) if self.resume_from else None

        self.data = run_data(
            config, self.mode.dataset(), rank=rank, world_size=world_size, device=device
        )
        self.global_batch = config.batch_size * world_size * config.grad_accum
        self._setup_networks(state)
        self._setup_optimization(state)
        # Rank 0's extra: the VAE of the sample grids.
        self.vae = None
        if rank == 0:
            self.vae = build_vae(self.model).to(device).eval().requires_grad_(False)

        progress = self.progress  # the run's own rows start here (sdtrain.lineage)
        self.lineage = RunLineage(
            config,
            self.data,
            digest=self.run_shape["manifest_sha256"],
            world_size=world_size,
            resume_from=self.resume_from,
            position=(progress.step, progress.epoch, progress.done),
        )
        self.monitor = Monitor(config, start_step=self.progress.step, enabled=rank == 0)
        self.stop_request = StopRequest()
        self.window = LogWindow(device)
        self.step_loss = torch.zeros((), device=device)  # this rank's, of the step in progress
        self.total_wait = 0.0
        self.resumed_from_step = self.saved_step = self.progress.step
        self.consistent = True  # weights, optimizer and EMA agree (no update half-done)
        self.nonfinite_in_a_row = 0

    def _setup_networks(self, state: dict | None) -> None:
        """The UNet from the checkpoint we resume, else the previous phase's final weights, else
        its mode's init (random, or a fine-tune's base), and its EMA; the frozen text encoder;
        what DDP wraps (compiled for the steps, each batch shape run once first: runtime.py).
        Same seed on every rank; DDP also broadcasts rank 0's weights."""
        from diffusers.models.attention_processor import AttnProcessor2_0

        config, device, mode = self.config, self.device, self.mode
        unet = mode.build_unet(resuming=self.resume_from is not None)
        weights_dir = self.resume_from or (Path(config.init_from) if config.init_from else None)
        if weights_dir:
            unet.load_state_dict(load_weights(weights_dir / "unet.safetensors"))
        unet.set_attn_processor(AttnProcessor2_0())  # SDPA: flash / memory-efficient kernels
        if config.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        memory_format = torch.channels_last if config.channels_last else torch.contiguous_format
        self.unet = unet.to(device, memory_format=memory_format).train()
        # The EMA's age before this run: a resumed run's own record, else the previous phase's.
        if state is not None:
            ema_age = state.get("ema_age", 0)
        elif config.init_from and config.ema_carry:
            ema_age = read_ema_step(Path(config.init_from))
        else:
            ema_age = 0
        self.ema = EMA(
            self.unet,
            decay=config.ema_decay,
            every=config.ema_every,
            device=torch.device("cpu") if config.ema_on_cpu else device,
            age=ema_age,
        )
        if weights_dir:
            self.ema.load_state_dict(load_weights(weights_dir / "unet_ema.safetensors"))
        # The frozen networks have fixed weights (seed 0 for the tiny twins, as the encode stage).
        text_encoder = build_text_encoder(self.model).to(device).eval().requires_grad_(False)
        self.text_encoder = mode.prepare_text_encoder(text_encoder, self.resume_from)
        data = self.data
        sampler = data.sampler if data.bucketed else None
        module, self.warmed = prepare_steps(
            mode,
            self.unet,
            self.text_encoder,
            config,
            device,
            self.autocast,
            (data.loader, data.dataset, sampler),
            self.rank,
        )
        self.ddp = DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )

    def _setup_optimization(self, state: dict | None) -> None:
        """Optimizer, LR schedule and grad scaler: fresh for every phase; restored, with the
        RNG and the progress, only when resuming this run."""
        config, data = self.config, self.data
        self.trained = self.mode.trainable_parameters(self.unet, self.text_encoder)
        self.optimizer = build_optimizer(
            self.trained,
            lr=config.lr,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.lr_schedule = build_lr_schedule(
            self.optimizer,
            warmup_steps=config.warmup_steps,
            total_steps=data.total_steps,
            kind=config.lr_schedule,
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.numerics.grad_scaler)
        self.run_shape = data.run_shape(config, global_batch=self.global_batch)
        self.progress = Progress()
        if state is None:
            return
        check_resumable(
            state,
            self.run_shape,
            bucketed=data.bucketed,
            resume_from=self.resume_from,
            manifest=Path(config.phase_dir) / "manifest.parquet",
            remixed=config.resume_remixed,
        )
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"][self.rank if len(state["rng"]) == self.world_size else 0])
        self.progress = Progress(
            step=state["step"],
            epoch=state["epoch"],
            done=state["batches_done"] if data.bucketed else state["samples_done"],
            best_val_loss=state["best_val_loss"],
            num_nonfinite=state.get("num_nonfinite", 0),
        )

    def run(self) -> dict | None:
        """Fit; rank 0 then writes final/ and returns the summary it wrote, other ranks None.
        A failure saves the last finished step first (a stop or divergence already did)."""
        loop_start = time.perf_counter()
        with self.stop_request.installed():
            try:
                self.fit()
            except (TrainingInterrupted, TrainingDiverged):
                self.monitor.close()
                raise
            except BaseException:
                self.save_on_failure()
                self.monitor.close()
                raise
        return self.finish(time.perf_counter() - loop_start) if self.rank == 0 else None

    def fit(self) -> None:
        """The micro-batches in order to the run's last optimizer step: every `grad_accum`-th
        steps the optimizer, then logs, stops, validates, checkpoints and samples when due."""
        config, progress, total_steps = self.config, self.progress, self.data.total_steps
        batches = self.data.batches(
            epoch=progress.epoch, done=progress.done, num_epochs=config.epochs
        )
        micro_step = 0
        for epoch, done, batch, waited in batches:
            if progress.step == total_steps:
                break
            self.window.wait += waited
            self.window.rows.append(batch[-1])  # a batch's last item: its rows
            micro_step += 1
            steps_now = micro_step % config.grad_accum == 0
            self.forward_backward_step(batch, epoch=epoch, sync=steps_now)
            if not steps_now:
                continue
            stopping = self.train_step(epoch, done)

            step = progress.step
            if step % config.log_every == 0 or step == total_steps or stopping:
                self.log()
            if stopping:
                self.stop()
            is_best = False
            validate_now = step == total_steps or (
                config.validate_every > 0 and step % config.validate_every == 0
            )
            if len(self.data.val_rows) and validate_now:
                is_best = self.validate()
            if self.checkpoints.policy.due(step, total_steps) or is_best:
                self.save_checkpoint(is_best=is_best)
            grid_due = config.sample_every > 0 and step % config.sample_every == 0
            if self.rank == 0 and grid_due and step != total_steps:  # the last: samples/final.png
                grid_path = self.run_dir / "samples" / f"step-{step:06d}.png"
                self.monitor.grid(step, self.sample_grid(), grid_path)

    def forward_backward_step(self, batch, *, epoch: int, sync: bool) -> None:
        """The mode's loss of one micro-batch, its gradients accumulated (all-reduced across the
        ranks only when `sync`: on the micro-batch that steps the optimizer)."""
        accum = self.config.grad_accum
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            with self.autocast():
                loss = self.mode.loss(self.ddp, batch, epoch=epoch)
            self.scaler.scale(loss / accum).backward()
        self.step_loss += loss.detach() / accum

    def train_step(self, epoch: int, done: int) -> bool:
        """The optimizer step on the accumulated gradients, clipped, then the EMA's; `epoch` and
        `done` are the data's position after it. One all-reduce: was any rank told to stop, is
        any rank's loss or the (all-reduced, so common) gradient norm NaN/inf. A non-finite step
        updates neither the weights, the optimizer moments nor the EMA (under fp16 the
        GradScaler owns infinite gradients: it skips those and lowers its scale); too many in a
        row raise TrainingDiverged. Returns whether to stop."""
        progress, scaler, optimizer, window = (
            self.progress,
            self.scaler,
            self.optimizer,
            self.window,
        )
        self.consistent = False  # weights, optimizer and EMA disagree until the EMA update
        scaler.unscale_(optimizer)
        window.grad_norm = torch.nn.utils.clip_grad_norm_(self.trained, self.config.max_grad_norm)
        window.lr = self.lr_schedule.get_last_lr()[0]
        checks = torch.stack(
            [
                torch.tensor(float(self.stop_request.requested), device=self.device),
                (~torch.isfinite(self.step_loss)).float(),
                (~torch.isfinite(window.grad_norm)).float() * (not self.numerics.grad_scaler),
            ]
        )
        dist.all_reduce(checks)
        stopping, nonfinite = bool(checks[0] > 0), bool(checks[1:].sum() > 0)
        if nonfinite:
            progress.num_nonfinite += 1
            self.nonfinite_in_a_row += 1
            if self.numerics.grad_scaler:
                scaler.update()
            print(
                f"step {progress.step + 1}: non-finite loss or gradient norm, skipped "
                f"({self.nonfinite_in_a_row} in a row, {progress.num_nonfinite} in all)",
                flush=True,
            )
        else:
            scaler.step(optimizer)
            scaler.update()
            self.nonfinite_in_a_row = 0
            window.loss += self.step_loss
            window.finite += 1
        self.lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        self.step_loss.zero_()
        progress.step += 1
        if not nonfinite and self.ema.due(progress.step):
            self.ema.update(self.unet, progress.step)
        progress.epoch, progress.done = epoch, done
        self.consistent = True
        window.steps += 1
        if self.nonfinite_in_a_row >= self.config.max_nonfinite_steps:
            raise TrainingDiverged(
                f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss "
                f"or gradient norm, the last at step {progress.step}/{self.data.total_steps}: "
                f"stopped. The weights were not updated by them; the last checkpoint is "
                f"{self.checkpoints.latest() or 'none'}. Lower the learning rate (or check "
                "the phase set's latents) and rerun to resume from it"
            )
        return stopping

    def log(self) -> None:
        """A record of the window: the mean loss of its finite steps over all ranks (every rank
        takes part in the all-reduce), rates, and a checksum of rank 0's rows."""
        window = self.window
        reduced = window.loss.clone()
        dist.all_reduce(reduced)
        now = time.perf_counter()
        finite = window.finite
        self.monitor.step(
            self.progress.step,
            self.data.total_steps,
            {
                "loss": reduced.item() / (finite * self.world_size) if finite else float("nan"),
                "lr": window.lr,
                "grad_norm": window.grad_norm.item(),
                "samples_per_s": window.steps * self.global_batch / (now - window.start),
                "data_wait": window.wait / (now - window.start),
                "nonfinite_steps": window.steps - finite,
            },
            rows_crc=zlib.crc32(torch.cat(window.rows).numpy().tobytes()),
        )
        self.total_wait += window.wait
        window.reset(now)

    def stop(self) -> NoReturn:
        """A signal's stop: what a resume needs first, since nothing else fits the grace period."""
        step = self.progress.step
        self.save_checkpoint(is_best=False)
        raise TrainingInterrupted(
            f"stopped by a signal at step {step}/{self.data.total_steps}; checkpoint "
            f"{self.checkpoints.step_dir(step)}; rerun to resume"
        )

    def validate(self) -> bool:
        """The EMA weights' validation loss over all ranks; returns whether it is the best yet."""
        with self.ema.swapped_into(self.unet):
            val_loss = validation_loss(
                self.unet,
                self.data.dataset,
                self.data.val_rows,
                self.text_encoder,
                self.config,
                self.autocast,
            )
        is_best = val_loss < self.progress.best_val_loss
        self.progress.best_val_loss = min(self.progress.best_val_loss, val_loss)
        self.monitor.validation(self.progress.step, val_loss, is_best=is_best)
        return is_best

    def sample_grid(self):
        """The mode's picture of the run (a phase's: the sample prompts) from the EMA weights."""
        with self.ema.swapped_into(self.unet):
            return self.mode.sample_grid(self.unet, self.vae, self.autocast)

    def save_checkpoint(self, *, is_best: bool, all_ranks: bool = True) -> None:
        """The resumable state after this step (every rank's RNG unless one rank saves alone)."""
        rngs = [None] * self.world_size if self.rank == 0 else None
        if all_ranks:
            dist.gather_object(rng_state(), rngs, dst=0)
        else:
            rngs = [rng_state()]
        if self.rank != 0:
            return
        progress, bucketed = self.progress, self.data.bucketed
        self.checkpoints.save(
            progress.step,
            is_best=is_best,
            unet=self.unet.state_dict(),
            unet_ema=self.ema.state_dict(),
            config=self.config,
            ema_step=self.ema.age + progress.step,
            extra=self.mode.extra_weights(self.text_encoder),
            lineage=self.lineage.at(progress.step, progress.epoch, progress.done),
            trainer={
                "step": progress.step,
                "epoch": progress.epoch,
                "samples_done": None if bucketed else progress.done,
                "batches_done": progress.done if bucketed else None,
                "best_val_loss": progress.best_val_loss,
                "optimizer": self.optimizer.state_dict(),
                "lr_schedule": self.lr_schedule.state_dict(),
                "scaler": self.scaler.state_dict(),
                "rng": rngs,
                "run_shape": self.run_shape,
                "ema_age": self.ema.age,
                "num_nonfinite": progress.num_nonfinite,
            },
        )
        self.saved_step = progress.step

    def save_on_failure(self) -> None:
        """The state of the last finished step, unless the failure hit mid-update. Rank 0
        alone: the other ranks may be gone, so no collective."""
        if self.rank == 0 and self.consistent and self.progress.step > self.saved_step:
            print(f"saving the state of step {self.progress.step} before failing", flush=True)
            self.save_checkpoint(is_best=False, all_ranks=False)

    def finish(self, train_seconds: float) -> dict:
        """Rank 0: final/ (live and EMA weights), the last sample grid, summary.json."""
        config, data, step = self.config, self.data, self.progress.step
        final = write_checkpoint(
            self.run_dir / "final",
            unet=self.unet.state_dict(),
            unet_ema=self.ema.state_dict(),
            config=config,
            ema_step=self.ema.age + step,
            extra=self.mode.extra_weights(self.text_encoder),
            lineage=self.lineage.at(step, self.progress.epoch, self.progress.done),
        )
        grid_path = self.run_dir / "samples" / "final.png"
        self.monitor.grid(step, self.sample_grid(), grid_path)
        self.monitor.close()
        logged = [r for r in read_log(self.run_dir / "log.jsonl") if "loss" in r]
        steps_run = step - self.resumed_from_step
        best = self.checkpoints.best()
        summary = {
            "phase": config.phase,
            "steps": step,
            "total_steps": data.total_steps,
            "resumed_from_step": self.resumed_from_step,
            "first_loss": logged[0]["loss"] if logged else float("nan"),
            "last_loss": logged[-1]["loss"] if logged else float("nan"),
            "best_val_loss": self.progress.best_val_loss if len(data.val_rows) else None,
            "samples_per_s": steps_run * self.global_batch / train_seconds if steps_run else 0.0,
            "data_wait_fraction": self.total_wait / train_seconds if steps_run else 0.0,
            "nonfinite_steps": self.progress.num_nonfinite,
            "world_size": self.world_size,
            "checkpoint": str(final),
            "best_checkpoint": str(best) if best else None,
            "sample_grid": str(grid_path),
            "seconds": round(time.perf_counter() - self.started, 3),
            "warm_up": self.warmed,
        }
        if data.bucketed:  # training rows per bucket, those left out by reason, those sitting out
            sampler = data.sampler
            summary["buckets"] = sampler.buckets
            summary["left_out"] = {SMALL_BUCKET: sum(sampler.left_out.values())}
            summary["small_buckets"] = sampler.left_out
            summary["leftover_per_epoch"] = sampler.leftover_per_epoch
        write_json_atomic(self.run_dir / "summary.json", summary)
        return summary


def train(config: TrainConfig) -> dict | None:
    """Run (or resume) the phase; rank 0 returns the summary it wrote, other ranks None."""
    rank, world_size, device = setup_distributed()
    try:
        return Trainer(config, rank, world_size, device).run()
    finally:
        dist.destroy_process_group()


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
