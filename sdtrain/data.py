"""A phase set as a map-style dataset, and the seeded per-epoch sampler that shards it over ranks.

Each latent file is memory-mapped once and each token file read once, in `__init__`: a row is
then two array lookups, cheap enough for `num_workers=0`, and forked workers share the maps.
The sampler's order is a function of (seed, epoch, rank, world_size) alone, so a run can resume
mid-epoch by skipping the rows of its shard it already trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Sampler


class PhaseSet(Dataset):
    """Row i of `<phase_dir>/manifest.parquet` as (latent float32 [4,h,w], input_ids int64 [77])."""

    def __init__(self, phase_dir: str | Path):
        phase_dir = Path(phase_dir)
        manifest = pq.read_table(phase_dir / "manifest.parquet").to_pydict()
        file_names = [
            f"{source}-{shard}"
            for source, shard in zip(manifest["source"], manifest["shard"], strict=True)
        ]
        files = sorted(set(file_names))
        file_index = {name: i for i, name in enumerate(files)}
        self.file_of_row = np.array([file_index[name] for name in file_names], dtype=np.int64)
        self.latent_rows = np.array(manifest["latent_row"], dtype=np.int64)
        self.token_rows = np.array(manifest["token_row"], dtype=np.int64)
        self.latents = [np.load(phase_dir / "latents" / f"{f}.npy", mmap_mode="r") for f in files]
        self.tokens = []
        keys = np.array(manifest["key"], dtype=object)
        for i, name in enumerate(files):
            table = pq.read_table(phase_dir / "tokens" / f"{name}.parquet")
            ids = table["input_ids"].combine_chunks().flatten().to_numpy()
            self.tokens.append(ids.reshape(len(table), -1).astype(np.int64))
            # latent and token rows are joined by position; the keys catch a mix-stage mismatch.
            rows = self.file_of_row == i
            token_keys = np.array(table["key"].to_pylist(), dtype=object)
            if not (token_keys[self.token_rows[rows]] == keys[rows]).all():
                raise ValueError(f"{phase_dir}/tokens/{name}.parquet: keys differ from manifest")

    def __len__(self) -> int:
        return len(self.file_of_row)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.file_of_row[i]
        latent = torch.from_numpy(self.latents[f][self.latent_rows[i]].astype(np.float32))
        return latent, torch.from_numpy(self.tokens[f][self.token_rows[i]])


class EpochSampler(Sampler[int]):
    """This rank's share of a permutation seeded by seed + epoch, from `start` on.

    The permutation is truncated to a multiple of world_size (like DistributedSampler with
    drop_last) and rank r takes every world_size-th index from r, so all ranks see equal counts.
    `start` counts indices of this rank's shard already consumed; `len` is what remains.
    """

    def __init__(self, num_samples: int, *, seed: int, rank: int = 0, world_size: int = 1):
        self.num_samples = num_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_per_rank = num_samples // world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.num_per_rank - self.start

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator)
        order = order[: self.num_per_rank * self.world_size]
        shard = order[self.rank :: self.world_size]
        return iter(shard[self.start :].tolist())
