"""Batch generation on a Ray cluster: Ray Data `map_batches` over the missing images, one
long-lived actor per GPU (`num_gpus=1`), each holding the networks.

Ray schedules the actors and feeds them; the files and their records are the same as
`tasks.generation.generate` writes, so a batch started on one engine resumes on the other. The
output folder must be on storage every node sees.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
import torch

from tasks.generation.generate import (
    DEFAULT_SETTINGS,
    DeviceWorker,
    Item,
    Progress,
    Prompt,
    Settings,
    Weights,
    batch_lock,
    finish,
    make_chunks,
    start,
)
from tasks.runtime.ray_connect import connect


class RayWorker:
    """A Ray Data actor: the networks on the GPU Ray gave it (or the CPU), for every batch."""

    def __init__(self, weights: Weights, out_dir: str, threads: int):
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids:  # Ray narrowed CUDA_VISIBLE_DEVICES to this actor's GPU: it is cuda:0 here
            device, label = torch.device("cuda", 0), f"cuda:{gpu_ids[0]}"
        else:
            torch.set_num_threads(threads)
            device, label = torch.device("cpu"), "cpu"
        self.worker = DeviceWorker(weights, device, Path(out_dir), label=label)
        self.host = socket.gethostname()

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        items = [Item(**row) for row in batch.to_pylist()]
        made = sum(self.worker.run(chunk) for chunk in make_chunks(items, len(items)))
        return {"made": np.array([made]), "host": np.array([self.host])}


def generate_images_on_ray(
    weights: str | Path,
    prompts: Sequence[str | Prompt],
    seeds: Sequence[int],
    out_dir: str | Path,
    *,
    num_workers: int | None = None,
    gpus_per_worker: float | None = None,
    cpus_per_worker: float = 1,
    settings: Settings = DEFAULT_SETTINGS,
    use_ema: bool = True,
    batch_size: int = 8,
    on_progress: Callable[[int, int], None] | None = None,
) -> pa.Table:
    """`tasks.generation.generate.generate_images` on the Ray cluster this process is connected to
    (or RAY_ADDRESS, or a local one). `gpus_per_worker`: default 1, or 0 (CPU actors) on a cluster
    without GPUs, where GPU actors would wait forever. `num_workers`: actors (default: as many
    as the cluster's GPUs, or CPUs, hold)."""
    connect(None)  # the open connection, else RAY_ADDRESS (its token checked), else a local Ray
    if gpus_per_worker is None:
        gpus_per_worker = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    out_dir = Path(out_dir).absolute()
    with batch_lock(out_dir):
        w, items, pending = start(
            weights, prompts, seeds, out_dir, settings=settings, use_ema=use_ema
        )
        progress = Progress(len(items), len(items) - len(pending), on_progress)
        if pending:
            # Rows in settings order, so a batch of consecutive rows is mostly one chunk.
            rows = [asdict(it) for chunk in make_chunks(pending, batch_size) for it in chunk]
            num_chunks = math.ceil(len(rows) / batch_size)
            actors = min(
                num_workers or _cluster_workers(gpus_per_worker, cpus_per_worker), num_chunks
            )
            made = ray.data.from_items(rows).map_batches(
                RayWorker,
                fn_constructor_kwargs={
                    "weights": w,
                    "out_dir": str(out_dir),
                    "threads": max(1, int(cpus_per_worker)),
                },
                batch_size=batch_size,
                batch_format="pyarrow",
                num_gpus=gpus_per_worker,
                num_cpus=cpus_per_worker,
                concurrency=max(1, actors),
            )
            for batch in made.iter_batches(batch_size=None):
                progress.add(int(batch["made"].sum()))
        return finish(out_dir, w, items)


def _cluster_workers(gpus_per_worker: float, cpus_per_worker: float) -> int:
    resources = ray.cluster_resources()
    if gpus_per_worker > 0:
        return max(1, int(resources.get("GPU", 0) // gpus_per_worker))
    return max(1, int(resources.get("CPU", 1) // cpus_per_worker))
