"""A run's data on this rank: the rows held out for validation, the loader of the rest, the
optimizer steps they give, the micro-batches in order from a resume point. A phase set of
several buckets (or with flips, latent draws, train-time captions) is read in batches of one
bucket, progress counted in global batches; any other through the epoch sampler, in samples
of all ranks (`bucket_batches.uses_bucketed_sampler`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from sdtrain.bucket_batches import SMALL_BUCKET
from sdtrain.config import TrainConfig
from sdtrain.data import BucketBatchSampler, EpochSampler, PhaseSet, collate, split_rows
from sdtrain.schedules import total_optimizer_steps


@dataclass(kw_only=True, slots=True)
class RunData:
    dataset: Dataset  # a PhaseSet, or a fine-tune's set (the mode's)
    train_rows: np.ndarray
    val_rows: np.ndarray
    sampler: EpochSampler | BucketBatchSampler
    loader: DataLoader
    total_steps: int
    done_per_batch: int  # progress a micro-batch adds, in the sampler's unit

    @property
    def bucketed(self) -> bool:
        return isinstance(self.sampler, BucketBatchSampler)

    def run_shape(self, config: TrainConfig, *, global_batch: int) -> dict:
        """What a resumed checkpoint must have been written with (sdtrain.checkpoint
        `check_resumable`): the phase set's manifest digest among them, since the same row count
        over other samples must not resume."""
        shape = {
            "total_steps": self.total_steps,
            "global_batch": global_batch,
            "num_train_rows": len(self.train_rows),
            "seed": config.seed,
            "prediction_type": config.prediction_type,
            "manifest_sha256": manifest_digest(config.phase_dir),
        }
        if self.bucketed:  # the same count is the same cut of the same buckets into global batches
            shape["batches_per_epoch"] = self.sampler.num_batches
        return shape

    def batches(self, *, epoch: int, done: int, num_epochs: int):
        """The micro-batches from `done` into `epoch` on (`epoch_batches`)."""
        return epoch_batches(
            self.loader,
            self.sampler,
            start_epoch=epoch,
            start_done=done,
            num_epochs=num_epochs,
            done_per_batch=self.done_per_batch,
        )


def manifest_digest(phase_dir: str | Path) -> str:
    """sha256 of the phase set's manifest: which samples, in which rows."""
    with open(Path(phase_dir) / "manifest.parquet", "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def run_data(
    config: TrainConfig, dataset: Dataset, *, rank: int, world_size: int, device: torch.device
) -> RunData:
    """Validation rows held out by a seeded draw; the rest in a per-epoch seeded order. Fails,
    naming the set and the numbers, when they give no optimizer step."""
    train_rows, val_rows = split_rows(len(dataset), config.num_val_samples, config.seed)
    loading = dict(
        num_workers=config.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=config.num_workers > 0,
    )
    bucketed = isinstance(dataset, PhaseSet) and dataset.bucketed
    if bucketed:
        sampler = BucketBatchSampler(
            train_rows,
            dataset.bucket_of_row[train_rows],
            dataset.bucket_names,
            batch_size=config.batch_size,
            seed=config.seed,
            rank=rank,
            world_size=world_size,
        )
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loading)
        left_out = sum(sampler.left_out.values())
        if left_out and rank == 0:
            print(
                f"left out {left_out} training rows under {SMALL_BUCKET} (buckets with fewer "
                f"than one global batch of {sampler.global_batch}): "
                + ", ".join(f"{b} ({n})" for b, n in sampler.left_out.items()),
                flush=True,
            )
        done_per_batch = 1
    else:
        sampler = EpochSampler(len(train_rows), seed=config.seed, rank=rank, world_size=world_size)
        loader = DataLoader(
            Subset(dataset, train_rows),  # an array: no Python int per row
            batch_size=config.batch_size,
            sampler=sampler,
            drop_last=True,  # equal micro-batches on every rank and every step
            **loading,
        )
        left_out, done_per_batch = 0, config.batch_size * world_size
    total_steps = total_optimizer_steps(
        len(loader), epochs=config.epochs, grad_accum=config.grad_accum, max_steps=config.max_steps
    )
    if total_steps == 0:
        small = f" ({left_out} in buckets too small)" if bucketed else ""
        raise ValueError(
            f"{config.phase_dir}: {len(train_rows)} training rows{small} give no optimizer step "
            f"at batch_size {config.batch_size} x {world_size} ranks x grad_accum "
            f"{config.grad_accum}"
        )
    return RunData(
        dataset=dataset,
        train_rows=train_rows,
        val_rows=val_rows,
        sampler=sampler,
        loader=loader,
        total_steps=total_steps,
        done_per_batch=done_per_batch,
    )


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
