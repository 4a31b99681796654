"""A phase set as a map-style dataset, and the seeded per-epoch samplers that shard it over ranks.

Nothing is held per row but what mix wrote: the row index (`rows.npy`, int32 [N, 3]), latents
and token ids (int32) are memory-mapped, so the ranks of a machine share one copy through the
page cache; a row is three array lookups, widened to float32 / int64 as it is read. The order
is a function of (seed, epoch) alone, so a resumed epoch starts at the exact next sample: none
replayed, none skipped. Layout: `sdtrain.layout`.

A set of several buckets (aspect ratios), or one its phase flips or draws latents from, is
read through `BucketBatchSampler`: a batch holds one bucket, and its items are (row, epoch)
pairs, so a row's flip and latent draw are seeded per (seed, epoch, row) with nothing held per
row. A one-bucket set without either keeps `EpochSampler` and its order. The contract:
docs/training-data.md ("Phase sets", "The sampler").
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Sampler

from sdtrain import fingerprints, layout
from sdtrain.bucket_batches import bucketed_batches, leftover_rows, uses_bucketed_sampler
from sdtrain.captions import TrainTimeCaptions
from sdtrain.objective import FLIP_STREAM, LATENT_STREAM, ORDER_STREAM


def bucket_name(latent_h: int, latent_w: int) -> str:
    """The bucket ("WxH", pixels) of latents of these sides."""
    return f"{latent_w * 8}x{latent_h * 8}"


def latent_sides(bucket: str) -> tuple[int, int]:
    """(h, w) of a bucket's latents."""
    width, height = (int(side) for side in bucket.split("x"))
    return height // 8, width // 8


def flipped(seed: int, epoch: int, row: int, flip_p: float) -> bool:
    """Whether `row` is read mirrored in `epoch`: a draw of its own per (seed, epoch, row)."""
    if flip_p <= 0:
        return False
    return bool(np.random.default_rng((seed, FLIP_STREAM, epoch, row)).random() < flip_p)


def latent_eps(seed: int, epoch: int, row: int, shape: tuple[int, ...]) -> np.ndarray:
    """The standard normal draw of `row`'s latent in `epoch` (float32)."""
    rng = np.random.default_rng((seed, LATENT_STREAM, epoch, row))
    return rng.standard_normal(shape, dtype=np.float32)


class PhaseSet(Dataset):
    """Row i of `<phase_dir>/manifest.parquet` as (latent f32 [4,h,w], input_ids i64 [77], i).

    Token ids come from `tokens/<file>.npy` (memory-mapped int32); a token file without one
    (tokenized by an older sdpipe) is read from its parquet into RAM, as int32, and its keys are
    checked against the manifest's.

    Latent files are [N, 4, h, w] (legacy) or [n, V, C, h, w]: view 1 the mirrored image's,
    channels 4..7 the log-variance of the scaled posterior. A file entry of `files.json` names
    its `bucket`, `views` and `channels`; without a bucket they come from the file's header
    (a set none of whose files names one, as mix wrote them before buckets, is taken to hold
    its first file's shape throughout, each file checked when it is mapped: opening reads one
    header, not one per shard).

    An item is `set[row]` (view 0, the posterior mean: validation, the legacy order) or
    `set[row, epoch]` (the bucketed sampler's): view 1 when `flipped(seed, epoch, row, flip_p)`,
    and `mean + exp(logvar / 2) * eps` when the file holds the log-variance and the phase
    `sample_latents`.
    """

    def __init__(
        self,
        phase_dir: str | Path,
        *,
        in_ram: bool = False,
        num_threads: int = 16,
        seed: int = 0,
        flip_p: float = 0.0,
        sample_latents: bool = True,
        captions: TrainTimeCaptions | None = None,
        name: str = "",
    ):
        phase_dir = Path(phase_dir)
        if not 0 <= flip_p <= 1:
            raise ValueError(f"flip_p={flip_p}: a probability, within [0, 1]")
        # StalePhaseSet: a source moved the rows the set reads (now, or before a file is mapped)
        map_check = fingerprints.check(phase_dir)
        index = layout.mapped_index(phase_dir)
        files, self.rows = index if index is not None else layout.derived_index(phase_dir)
        self.names = [f["name"] for f in files]
        if map_check is not None:
            map_check.bind(self.names)
        self.seed, self.flip_p = seed, flip_p
        self.captions = captions  # train-time captions (sdtrain.captions): ids drawn per epoch
        latent_paths = [phase_dir / "latents" / f"{n}.npy" for n in self.names]
        tails = self._describe(phase_dir, files)
        # Mapped on first use: opening reads no file (10,000 shards open in a blink).
        self.latents = _Mapped(
            latent_paths,
            [f["latent_rows"] for f in files],
            tails,
            check=map_check and map_check.latents,
        )
        token_files = [phase_dir / "tokens" / f"{n}.npy" for n in self.names]
        # One listing of the links, not a stat of each (every rank opens the set; 10,000 shards
        # on NFS); a link whose target is gone is named when its file is first mapped.
        linked = _names_in(phase_dir / "tokens")
        missing = [f for f, n in enumerate(self.names) if f"{n}.npy" not in linked]
        self.tokens = _Mapped(
            token_files, [f["token_rows"] for f in files], check=map_check and map_check.ids
        )
        if missing:
            self._read_token_parquets(phase_dir, missing)
        self.draws_latents = sample_latents and bool((self.file_channels == 8).any())
        if flip_p > 0 and (self.file_views < 2).any():
            unflipped = [self.names[f] for f in np.flatnonzero(self.file_views < 2).tolist()]
            raise ValueError(
                f"{name or phase_dir.name} asks flip_p but its latents hold no mirrored view "
                f"({len(unflipped)} of {len(self.names)} files, e.g. latents/{unflipped[0]}.npy): "
                "encode the source again (flips are encoded when a phase mixing it has flip_p > 0)"
            )
        self._bucket_of_row: np.ndarray | None = None
        self.in_ram = False  # True: an array of latents per bucket and one of ids, by row
        if in_ram:
            self._load_into_ram(num_threads)

    def _describe(self, phase_dir: Path, files: list[dict]) -> list[tuple[int, ...]]:
        """Each file's bucket, views and channels (its `files.json` entry, or its header:
        `layout.with_file_fields`); returns the (V, C, h, w) its array must hold."""
        tails = []
        for entry in files:
            if not entry["bucket"]:
                raise FileNotFoundError(
                    f"{phase_dir / 'latents'}: none of the set's legacy latents files is "
                    f"there (e.g. {entry['name']}.npy): build the sources' latents, then mix "
                    "the phase again"
                )
            h, w = latent_sides(entry["bucket"])
            tails.append((int(entry.get("views", 1)), int(entry.get("channels", 4)), h, w))
        buckets = [bucket_name(h, w) for _, _, h, w in tails]
        self.bucket_names = sorted(set(buckets))
        code = {b: i for i, b in enumerate(self.bucket_names)}
        self.file_bucket = np.array([code[b] for b in buckets], np.int32)
        self.file_views = np.array([t[0] for t in tails], np.int32)
        self.file_channels = np.array([t[1] for t in tails], np.int32)
        return tails

    @property
    def bucketed(self) -> bool:
        """Read by `BucketBatchSampler`: several buckets, flips, latent draws or train-time
        captions (each needs the epoch with the row, which only that sampler gives)."""
        return uses_bucketed_sampler(
            len(self.bucket_names),
            flips=self.flip_p > 0,
            latent_draws=self.draws_latents,
            train_time_captions=self.captions is not None,
        )

    @property
    def bucket_of_row(self) -> np.ndarray:
        """int32 [N]: each row's bucket (an index into `bucket_names`), gathered on first use."""
        if self._bucket_of_row is None:
            self._bucket_of_row = self.file_bucket[np.asarray(self.rows[:, 0])]
        return self._bucket_of_row

    def row_batches(self, rows: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
        """Positions in `rows` in batches of one bucket each (of one bucket: consecutive)."""
        if len(self.bucket_names) == 1:
            for start in range(0, len(rows), batch_size):
                yield np.arange(start, min(start + batch_size, len(rows)))
            return
        codes = self.bucket_of_row[np.asarray(rows)]
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(self.bucket_names) + 1))
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            for start in range(a, b, batch_size):
                yield order[start : min(start + batch_size, b)]

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
        """Gather every row's latent into its bucket's array, one file per thread (reads release
        the GIL): only the views and channels the phase reads (a file without the log-variance
        a bucket holds gets -inf there, a standard deviation of 0: its mean).

        Token ids are gathered the same way; afterwards rows are read from these arrays.
        """
        views = 2 if self.flip_p > 0 else 1
        channels = 8 if self.draws_latents else 4
        codes = self.bucket_of_row
        counts = np.bincount(codes, minlength=len(self.bucket_names))
        order = np.argsort(codes, kind="stable")
        position = np.empty(len(self), np.int32)  # a row's place in its bucket's array
        position[order] = np.arange(len(self)) - np.repeat(np.cumsum(counts) - counts, counts)
        dtype = self.latents[0].dtype
        buckets = [
            np.empty((n, views, channels, *latent_sides(name)), dtype=dtype)
            for n, name in zip(counts.tolist(), self.bucket_names, strict=True)
        ]
        tokens = np.empty((len(self), self.tokens[0].shape[1]), dtype=np.int32)
        rows_of_file = self._rows_by_file()

        def load(f: int) -> None:
            rows = rows_of_file[f]
            latent_rows = np.asarray(self.rows[rows, 1])
            by_position = np.argsort(latent_rows)  # read each file front to back
            stored = self.latents[f][latent_rows[by_position]]
            into, at = buckets[self.file_bucket[f]], position[rows[by_position]]
            into[at, :, :4] = stored[:, :views, :4]
            if channels == 8:
                into[at, :, 4:] = stored[:, :views, 4:] if stored.shape[2] == 8 else -np.inf
            tokens[rows] = self.tokens[f][np.asarray(self.rows[rows, 2])]

        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            list(pool.map(load, range(len(self.latents))))
        self.latents, self.tokens = _Mapped.of(*buckets), _Mapped.of(tokens)
        self._ram_position = position
        self.in_ram = True

    def __len__(self) -> int:
        return len(self.rows)

    def _stored_latent(self, row: int) -> np.ndarray:
        """The row's stored latents, [V, C, h, w]."""
        if self.in_ram:
            return self.latents[int(self.bucket_of_row[row])][self._ram_position[row]]
        f, latent_row = self.rows[row, :2].tolist()
        return self.latents[f][latent_row]

    def token_ids(self, row: int) -> np.ndarray:
        """The row's token ids stored by the tokenize stage, int32 [77] (train-time captions
        are text in the items, tokenized by `collate`)."""
        if self.in_ram:
            return self.tokens[0][row]
        f, _, token_row = self.rows[row].tolist()
        return self.tokens[f][token_row]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        if isinstance(key, tuple):
            row, epoch = int(key[0]), int(key[1])
        else:
            row, epoch = int(key), None
        stored = self._stored_latent(row)
        view = int(epoch is not None and flipped(self.seed, epoch, row, self.flip_p))
        latent = stored[view, :4].astype(np.float32)
        if epoch is not None and self.draws_latents and stored.shape[1] == 8:
            std = np.exp(stored[view, 4:].astype(np.float32) / 2)
            latent += std * latent_eps(self.seed, epoch, row, latent.shape)
        if self.captions is not None and epoch is not None:
            # The epoch's caption as text: `collate` tokenizes the batch's captions in one call.
            return torch.from_numpy(latent), self.captions.caption(row, epoch), row
        ids = self.token_ids(row)
        return torch.from_numpy(latent), torch.from_numpy(ids.astype(np.int64)), row


def collate(items: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of PhaseSet items: latents stacked, ids stacked or, for train-time captions
    (text), tokenized together (a batch costs about half of one call per caption), rows."""
    from torch.utils.data import default_collate

    if not items or not isinstance(items[0][1], str):
        return default_collate(items)
    from sdtrain.models import encode_captions

    ids, _ = encode_captions([caption for _, caption, _ in items])
    latents = torch.stack([latent for latent, _, _ in items])
    return latents, torch.from_numpy(ids.astype(np.int64)), torch.tensor([r for *_, r in items])


class _Mapped:
    """A phase set's arrays of one kind (latents or token ids), one per file, each memory-mapped
    on first use and checked then to hold the rows the manifest reads. Latents (`tails` given)
    are seen as [n, V, C, h, w] (a legacy [N, 4, h, w] file as V = 1) and checked to hold the
    (V, C, h, w) the set's index says.

    `check(f, stat)`, when given, is called with the stat of each file's descriptor as it is
    mapped (`fingerprints.MapCheck`: the set's sources may change between its open and a map).

    At most `max_open` maps are held: past it the least recently used is let go (and mapped
    again when a row of it is read). A bucketed set of 10,000 shards has a latents file per
    (shard, bucket), some 200,000, and a process may hold only `vm.max_map_count` maps (65,530
    by default); a row read is copied out of its map, so nothing refers to a map let go.
    """

    def __init__(
        self,
        paths: list[Path],
        needed: list[int],
        tails: list[tuple[int, ...]] | None = None,
        *,
        check: Callable[[int, os.stat_result], None] | None = None,
        max_open: int | None = None,
    ):
        self.paths, self.needed, self.tails, self.check = paths, needed, tails, check
        self.arrays: list[np.ndarray | None] = [None] * len(paths)
        self.max_open = max_open or default_max_open()
        self.open: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lock = threading.Lock()  # the in-RAM load maps files from several threads

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, *arrays: np.ndarray) -> _Mapped:
        """Arrays already in memory."""
        mapped = cls([], [])
        mapped.arrays = list(arrays)
        return mapped

    def __len__(self) -> int:
        return len(self.arrays)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[f] for f in range(len(self)))

    def __getitem__(self, f: int) -> np.ndarray:
        array = self.arrays[f]
        if array is not None:
            if f in self.open:
                with self._lock:
                    if f in self.open:
                        self.open.move_to_end(f)
            return array
        path = self.paths[f]
        array, stat = layout.mapped_npy(path)
        if self.check is not None:
            self.check(f, stat)
        if len(array) < self.needed[f]:
            raise ValueError(
                f"{path} has {len(array)} rows, the manifest reads row {self.needed[f] - 1}: "
                "its source changed since the mix; mix the phase again"
            )
        if self.tails is not None:
            if array.ndim == 4:
                array = array.reshape(len(array), 1, *array.shape[1:])
            if array.shape[1:] != self.tails[f]:
                raise ValueError(
                    f"{path} holds latents [n, V, C, h, w] = {list(array.shape)}, the phase "
                    f"set's index says (V, C, h, w) = {self.tails[f]}: its source changed "
                    "since the mix; mix the phase again"
                )
        with self._lock:
            self.arrays[f] = array
            self.open[f] = None
            while len(self.open) > self.max_open:
                oldest, _ = self.open.popitem(last=False)
                self.arrays[oldest] = None
        return array


def _names_in(folder: Path) -> set[str]:
    try:
        with os.scandir(folder) as entries:
            return {e.name for e in entries}
    except FileNotFoundError:
        return set()


def default_max_open() -> int:
    """Maps one kind of a phase set's arrays may hold: a quarter of the process's map limit
    (latents and token ids take half; libraries, the loader and a second set the rest)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        limit = 65_530
    return max(64, limit // 4)


def split_rows(num_rows: int, num_val: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows): `num_val` rows held out by a seeded draw."""
    if num_val >= num_rows:
        raise ValueError(f"num_val_samples={num_val} leaves no training rows of {num_rows}")
    order = np.random.default_rng((seed, 2)).permutation(num_rows)
    # A mask, not a sort, puts the training rows in order: linear (100M rows: 2 s, not 10).
    training = np.ones(num_rows, bool)
    training[order[:num_val]] = False
    return np.flatnonzero(training), np.sort(order[:num_val])


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

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation, cut to a multiple of world_size: rank r takes every
        world_size-th from r (what all ranks draw, `sdtrain.lineage`, is this)."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        # int32 draws the same permutation as the default int64, in half the memory.
        small = self.num_samples <= torch.iinfo(torch.int32).max
        order = torch.randperm(
            self.num_samples, generator=generator, dtype=torch.int32 if small else torch.int64
        )
        return order[: self.num_per_rank * self.world_size]

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order(self.epoch)
        mine = order[self.start :][self.rank :: self.world_size].clone()
        del order
        return self._ints(mine)

    @staticmethod
    def _ints(indices: torch.Tensor) -> Iterator[int]:
        """The indices as Python ints, a block at a time (never a list of the whole epoch)."""
        for block in indices.split(1 << 16):
            yield from block.tolist()


class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """This rank's batches of an epoch, each of one bucket, as lists of (row, epoch).

    Per epoch, seeded by (seed, epoch): each bucket's rows are permuted and cut into global
    batches of batch_size x world_size (`bucketed_batches`); the batches of all buckets are
    shuffled together, and rank r takes its slice of each: the rows split as evenly as the
    count allows, at least one each, never more than batch_size. Every row of a kept bucket at
    most once per epoch, ranks disjoint, every rank the same number of batches; a bucket's
    leftover rows fewer than the ranks sit the epoch out (the last of its permutation: other
    rows each epoch; `leftover_per_epoch` rows in all, `sdtrain.bucket_batches.leftover_rows`).
    A bucket with fewer rows than one global batch is left out (`left_out`: bucket -> rows,
    reason `small_bucket`). `start` (set_epoch) counts the global batches of the epoch already
    done; `len` is what remains.

    Held: the kept rows grouped by bucket (int32), and an epoch's order of them while it runs.
    """

    def __init__(
        self,
        rows: np.ndarray,
        buckets: np.ndarray,
        bucket_names: list[str],
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.global_batch = batch_size * world_size
        counts = np.bincount(buckets, minlength=len(bucket_names))
        kept = counts >= self.global_batch
        self.left_out = {
            bucket_names[b]: int(counts[b]) for b in np.flatnonzero(~kept & (counts > 0)).tolist()
        }
        self.buckets = {bucket_names[b]: int(counts[b]) for b in np.flatnonzero(kept).tolist()}
        rows, buckets = np.asarray(rows, np.int32), np.asarray(buckets)
        # The kept rows grouped by bucket, a bucket at a time (no int64 sort index per row).
        self.rows = np.concatenate(
            [rows[buckets == b] for b in np.flatnonzero(kept).tolist()] or [rows[:0]]
        )
        self.counts = counts[kept]
        self.num_batches = bucketed_batches(counts, self.global_batch, world_size)
        self.leftover_per_epoch = int(leftover_rows(counts, self.global_batch, world_size).sum())
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.num_batches - self.start

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows in the epoch's order, int32; each global batch's start and size in it, in the
        order the batches are taken)."""
        rng = np.random.default_rng((self.seed, ORDER_STREAM, epoch))
        order = np.empty_like(self.rows)
        starts, sizes = [], []
        begin, size = 0, self.global_batch
        for count in self.counts.tolist():
            order[begin : begin + count] = self.rows[begin : begin + count]
            rng.shuffle(order[begin : begin + count])  # in place: no int64 index per row
            full, rest = divmod(count, size)
            cut = np.full(full + (rest >= self.world_size), size, np.int64)
            if rest >= self.world_size:
                cut[-1] = rest  # a short batch of its own, split among the ranks
            # else: too few for every rank, and joining the previous batch would give a rank
            # more than batch_size: the permutation's last `rest` rows sit this epoch out.
            starts.append(begin + np.cumsum(cut) - cut)
            sizes.append(cut)
            begin += count
        starts = np.concatenate(starts) if starts else np.empty(0, np.int64)
        sizes = np.concatenate(sizes) if sizes else np.empty(0, np.int64)
        taken = rng.permutation(len(sizes))
        return order, starts[taken], sizes[taken]

    def rank_batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows in the epoch's order, each global batch's first row of this rank in it, this
        rank's rows of it), in the order the batches are taken: the rows split as evenly as the
        count allows, the first `size % world_size` ranks one more."""
        order, starts, sizes = self.plan(epoch)
        base, extra = np.divmod(sizes, self.world_size)
        low = starts + self.rank * base + np.minimum(self.rank, extra)
        return order, low, base + (self.rank < extra)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order, low, count = self.rank_batches(self.epoch)
        epoch = self.epoch
        for first, n in zip(low[self.start :].tolist(), count[self.start :].tolist(), strict=True):
            yield [(row, epoch) for row in order[first : first + n].tolist()]
