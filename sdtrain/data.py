"""A phase set as a map-style dataset, and the seeded per-epoch sampler that shards it over ranks.

Nothing is held per row but what mix wrote: the row index (`rows.npy`, int32 [N, 3]), latents
and token ids (int32) are memory-mapped, so the ranks of a machine share one copy through the
page cache; a row is three array lookups, widened to float32 / int64 as it is read. The order
is a function of (seed, epoch) alone, so a resumed epoch starts at the exact next sample: none
replayed, none skipped. Layout: `sdtrain.layout`.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Sampler

from sdtrain import layout


class PhaseSet(Dataset):
    """Row i of `<phase_dir>/manifest.parquet` as (latent f32 [4,h,w], input_ids i64 [77], i).

    Token ids come from `tokens/<file>.npy` (memory-mapped int32); a token file without one
    (tokenized by an older sdpipe) is read from its parquet into RAM, as int32, and its keys are
    checked against the manifest's.
    """

    def __init__(self, phase_dir: str | Path, *, in_ram: bool = False, num_threads: int = 16):
        phase_dir = Path(phase_dir)
        index = layout.mapped_index(phase_dir)
        files, self.rows = index if index is not None else layout.derived_index(phase_dir)
        self.names = [f["name"] for f in files]
        # Mapped on first use: opening reads no file (10,000 shards open in a blink).
        self.latents = _Mapped(
            [phase_dir / "latents" / f"{n}.npy" for n in self.names],
            [f["latent_rows"] for f in files],
        )
        token_files = [phase_dir / "tokens" / f"{n}.npy" for n in self.names]
        missing = [f for f, path in enumerate(token_files) if not path.exists()]
        self.tokens = _Mapped(token_files, [f["token_rows"] for f in files])
        if missing:
            self._read_token_parquets(phase_dir, missing)
        self.in_ram = False  # True: one array of latents and one of ids, indexed by row
        if in_ram:
            self._load_into_ram(num_threads)

    def _rows_by_file(self) -> list[np.ndarray]:
        """Each file's manifest rows (one stable sort of the file column, not a mask per file)."""
        file_of_row = np.asarray(self.rows[:, 0])
        order = np.argsort(file_of_row, kind="stable")
        bounds = np.searchsorted(file_of_row[order], np.arange(len(self.names) + 1))
        return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def _read_token_parquets(self, phase_dir: Path, missing: list[int]) -> None:
        """Token files without an .npy: ids from the parquet (int32, in RAM), keys checked."""
        keys = pq.read_table(phase_dir / layout.MANIFEST, columns=["key"])["key"]
        rows_of_file = self._rows_by_file()
        for f in missing:
            rows = rows_of_file[f]
            name = self.names[f]
            table = pq.read_table(phase_dir / "tokens" / f"{name}.parquet")
            ids = table["input_ids"].combine_chunks().flatten().to_numpy()
            self.tokens.arrays[f] = ids.reshape(len(table), -1).astype(np.int32, copy=False)
            # latent and token rows are joined by position; the keys catch a mix-stage mismatch.
            token_rows = np.asarray(self.rows[rows, 2])
            if len(token_rows) and token_rows.max() >= len(table):
                raise ValueError(f"{phase_dir}/tokens/{name}.parquet: fewer rows than the manifest")
            same = pc.equal(table["key"].take(token_rows), keys.take(rows))
            if len(rows) and not pc.all(same).as_py():
                raise ValueError(f"{phase_dir}/tokens/{name}.parquet: keys differ from manifest")

    def _load_into_ram(self, num_threads: int) -> None:
        """Gather every row's latent into one array, one file per thread (reads release the GIL).

        Token ids are gathered the same way; afterwards rows are read from these two arrays.
        """
        shape = self.latents[0].shape[1:]
        latents = np.empty((len(self), *shape), dtype=self.latents[0].dtype)
        tokens = np.empty((len(self), self.tokens[0].shape[1]), dtype=np.int32)
        rows_of_file = self._rows_by_file()

        def load(f: int) -> None:
            rows = rows_of_file[f]
            latent_rows = np.asarray(self.rows[rows, 1])
            by_position = np.argsort(latent_rows)  # read each file front to back
            latents[rows[by_position]] = self.latents[f][latent_rows[by_position]]
            tokens[rows] = self.tokens[f][np.asarray(self.rows[rows, 2])]

        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            list(pool.map(load, range(len(self.latents))))
        self.latents, self.tokens = _Mapped.of(latents), _Mapped.of(tokens)
        self.in_ram = True

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.in_ram:
            latent, ids = self.latents[0][i], self.tokens[0][i]
        else:
            f, latent_row, token_row = self.rows[i].tolist()
            latent, ids = self.latents[f][latent_row], self.tokens[f][token_row]
        return (
            torch.from_numpy(latent.astype(np.float32)),
            torch.from_numpy(ids.astype(np.int64)),
            int(i),
        )


class _Mapped:
    """A phase set's arrays of one kind (latents or token ids), one per file, each memory-mapped
    on first use and checked then to hold the rows the manifest reads."""

    def __init__(self, paths: list[Path], needed: list[int]):
        self.paths, self.needed = paths, needed
        self.arrays: list[np.ndarray | None] = [None] * len(paths)

    @classmethod
    def of(cls, array: np.ndarray) -> _Mapped:
        """One array already in memory."""
        mapped = cls([], [])
        mapped.arrays = [array]
        return mapped

    def __len__(self) -> int:
        return len(self.arrays)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[f] for f in range(len(self)))

    def __getitem__(self, f: int) -> np.ndarray:
        array = self.arrays[f]
        if array is None:
            path = self.paths[f]
            array = layout.map_npy(path)
            if len(array) < self.needed[f]:
                raise ValueError(
                    f"{path} has {len(array)} rows, the manifest reads row {self.needed[f] - 1}: "
                    "its source changed since the mix; mix the phase again"
                )
            self.arrays[f] = array
        return array


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
        # int32 draws the same permutation as the default int64, in half the memory.
        small = self.num_samples <= torch.iinfo(torch.int32).max
        order = torch.randperm(
            self.num_samples, generator=generator, dtype=torch.int32 if small else torch.int64
        )
        order = order[: self.num_per_rank * self.world_size]
        mine = order[self.start :][self.rank :: self.world_size].clone()
        del order
        return self._ints(mine)

    @staticmethod
    def _ints(indices: torch.Tensor) -> Iterator[int]:
        """The indices as Python ints, a block at a time (never a list of the whole epoch)."""
        for block in indices.split(1 << 16):
            yield from block.tolist()
