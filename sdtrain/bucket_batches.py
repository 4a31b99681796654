"""How many global batches the bucketed sampler makes of each bucket in an epoch (numpy only).

The rule (docs/training-data.md, "The sampler"): a bucket's training rows are cut into global
batches of `batch_size x world_size`; the last, short batch is kept (split among the ranks,
each at least one row) when at least `world_size` rows remain, else those rows (fewer than the
ranks) sit the epoch out: no rank ever gets more than `batch_size` rows, and each epoch's
permutation leaves out other rows (`leftover_rows`, counted). A bucket with fewer rows than one
global batch is left out of the run (`small_bucket`). Every rank takes one slice of each global
batch, so the global batches of an epoch are also each rank's batches (steps before gradient
accumulation).

`sdpipe plan` counts steps with it; the sampler (`sdtrain.data`) cuts its batches by it.
"""

from __future__ import annotations

import numpy as np

SMALL_BUCKET = "small_bucket"


def small_buckets(counts: np.ndarray, global_batch: int) -> np.ndarray:
    """bool per bucket: fewer rows than one global batch (left out under `small_bucket`)."""
    return np.asarray(counts, np.int64) < global_batch


def batches_per_bucket(counts: np.ndarray, global_batch: int, world_size: int) -> np.ndarray:
    """int64 global batches per epoch of each bucket (0 for a bucket left out)."""
    if global_batch < 1 or world_size < 1 or global_batch % world_size:
        raise ValueError(
            f"global batch {global_batch} over {world_size} ranks: not a whole batch per rank"
        )
    counts = np.asarray(counts, np.int64)
    full, left = np.divmod(counts, global_batch)
    batches = full + (left >= world_size)
    return np.where(small_buckets(counts, global_batch), 0, batches)


def leftover_rows(counts: np.ndarray, global_batch: int, world_size: int) -> np.ndarray:
    """int64 rows per epoch of each kept bucket that sit the epoch out: its leftover rows after
    the full batches when fewer than `world_size` (a short batch needs one row per rank, and
    joining the previous batch would give a rank more than `batch_size`). Other rows each
    epoch: the last of that epoch's permutation of the bucket."""
    batches_per_bucket(counts, global_batch, world_size)  # the same checks
    counts = np.asarray(counts, np.int64)
    left = counts % global_batch
    return np.where(small_buckets(counts, global_batch) | (left >= world_size), 0, left)


def bucketed_batches(counts: np.ndarray, global_batch: int, world_size: int) -> int:
    """Global batches of an epoch over all buckets (= each rank's batches per epoch): per
    bucket with at least one global batch of rows, its full batches plus a short last batch
    when its leftover rows are at least `world_size` (fewer sit the epoch out)."""
    return int(batches_per_bucket(counts, global_batch, world_size).sum())


def uses_bucketed_sampler(
    num_buckets: int, *, flips: bool, latent_draws: bool, train_time_captions: bool
) -> bool:
    """Whether a run batches by bucket (`BucketBatchSampler`, items (row, epoch)): several
    buckets, or flips, latent draws or train-time captions, each of which needs the epoch with
    the row. Otherwise the plain sampler (`EpochSampler`) and its order, as before buckets."""
    return num_buckets > 1 or flips or latent_draws or train_time_captions


def shape_batches(phase_set, sampler) -> list[np.ndarray]:
    """The rows of the first batch of each (bucket, rows on this rank) that the bucketed
    `sampler` gives this rank in its epoch, each bucket's last short batch included (the sizes
    are the same every epoch; none is above `batch_size`)."""
    order, low, mine = sampler.rank_batches(sampler.epoch)
    buckets = np.asarray(phase_set.bucket_of_row)[order[low]]  # a batch is of one bucket
    _, first = np.unique(np.stack([buckets, mine], 1), axis=0, return_index=True)
    return [order[low[i] : low[i] + mine[i]] for i in np.sort(first).tolist()]


def warm_up_batches(loader, phase_set=None, sampler=None, shapes=None):
    """One batch of each shape this rank's loader will give (`runtime.warm_up`), collated as the
    loader collates: bucketed (`sampler`, a BucketBatchSampler over `phase_set`), those of
    `shape_batches` (epoch `sampler.epoch`; `shapes`: its result, when the caller has it);
    else the loader's first batch."""
    if sampler is None:
        yield loader.collate_fn([loader.dataset[i] for i in range(loader.batch_size)])
        return
    for rows in shape_batches(phase_set, sampler) if shapes is None else shapes:
        yield loader.collate_fn([phase_set[int(r), sampler.epoch] for r in rows])
