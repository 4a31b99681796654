"""A phase set as a map-style dataset, and the seeded per-epoch sampler that shards it over ranks.

Latents are memory-mapped, or gathered into RAM by a thread pool; token ids are read once. A row
is two array lookups, cheap enough for `num_workers=0`. The order is a function of (seed, epoch)
alone, so a resumed epoch starts at the exact next sample: none replayed, none skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Sampler


class PhaseSet(Dataset):
    """Row i of `<phase_dir>/manifest.parquet` as (latent f32 [4,h,w], input_ids i64 [77], i)."""

    def __init__(self, phase_dir: str | Path, *, in_ram: bool = False, num_threads: int = 16):
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
        if in_ram:
            self._load_into_ram(num_threads)

    def _load_into_ram(self, num_threads: int) -> None:
        """Gather every row's latent into one array, one file per thread (reads release the GIL).

        Token ids are gathered the same way; afterwards there is one "file", indexed by row.
        """
        shape = self.latents[0].shape[1:]
        ram = np.empty((len(self), *shape), dtype=self.latents[0].dtype)
        rows_of_file = [np.flatnonzero(self.file_of_row == f) for f in range(len(self.latents))]

        def load(f: int) -> None:
            rows = rows_of_file[f]
            by_position = np.argsort(self.latent_rows[rows])  # read each file front to back
            ram[rows[by_position]] = self.latents[f][self.latent_rows[rows][by_position]]

        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            list(pool.map(load, range(len(self.latents))))
        tokens = np.empty((len(self), self.tokens[0].shape[1]), dtype=self.tokens[0].dtype)
        for f, rows in enumerate(rows_of_file):
            tokens[rows] = self.tokens[f][self.token_rows[rows]]
        self.latents, self.tokens = [ram], [tokens]
        self.file_of_row = np.zeros(len(self), dtype=np.int64)
        self.latent_rows = self.token_rows = np.arange(len(self), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.file_of_row)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        f = self.file_of_row[i]
        latent = torch.from_numpy(self.latents[f][self.latent_rows[i]].astype(np.float32))
        return latent, torch.from_numpy(self.tokens[f][self.token_rows[i]]), i


def split_rows(num_rows: int, num_val: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows): `num_val` rows held out by a seeded draw."""
    if num_val >= num_rows:
        raise ValueError(f"num_val_samples={num_val} leaves no training rows of {num_rows}")
    order = np.random.default_rng((seed, 2)).permutation(num_rows)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


class EpochSampler(Sampler[int]):
    """This rank's share of a permutation seeded by seed + epoch, from sample `start` on.

    The permutation is truncated to a multiple of world_size (like DistributedSampler with
    drop_last) and rank r takes every world_size-th index from r, so all ranks see equal counts.
    `start` counts the samples of the epoch all ranks together have consumed; `len` is what
    remains for this rank.
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
        if start % self.world_size:
            raise ValueError(f"start={start} is not a multiple of world_size={self.world_size}")
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.num_per_rank - self.start // self.world_size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator)
        order = order[: self.num_per_rank * self.world_size]
        return iter(order[self.start :][self.rank :: self.world_size].tolist())
