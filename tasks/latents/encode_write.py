"""The writer of encode: a shard's encoded latents -> its files (`NNNNN.npy`, or one
`NNNNN.WxH.npy` per bucket) and keys file, renamed into place before its stats record."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from catalog import Model
from sdtrain.atomic import atomic_path
from tasks.latents import latent_keys
from tasks.latents.encode_pipeline import (
    Encoded,
)
from tasks.latents.encode_spec import STAGE, LatentSpec
from tasks.runtime.shards import ShardStats


def _encoded_before(root: Path, source: str, shard: str) -> bool:
    """Whether an earlier encode of the shard got as far as its keys file (written after its
    latent files), or left a legacy file (an older sdpipe wrote no keys file): only then can
    latent files of another spec be there to remove. Two stats, not a listing."""
    folder = root / source / STAGE
    return latent_keys.path(root, source, shard).exists() or (folder / f"{shard}.npy").exists()


def _remove_stale(root: Path, source: str, shard: str, keep: set[str], before: bool) -> None:
    """Latent files of the shard not written now (another spec's buckets, or its legacy file).
    The folder (every shard's files) is listed only if the shard was `before` encoded."""
    if not before:
        return
    folder = root / source / STAGE
    for p in [*folder.glob(f"{shard}.npy"), *folder.glob(f"{shard}.*.npy")]:
        if p.name not in keep:
            p.unlink(missing_ok=True)


def _commit(
    root: Path, source: str, model: Model, spec: LatentSpec, encoded: Encoded, stats: ShardStats
):
    job = encoded.job
    if job.shard != stats.shard:  # the pipeline yields shards in the order it was given them
        raise RuntimeError(f"encode: got shard {job.shard} for {stats.shard}")
    before = _encoded_before(root, source, job.shard)
    if not spec.legacy:
        _commit_bucketed(root, source, model, spec, encoded, stats, before)
        return
    stats.num_in = job.num_in
    if missing := job.num_in - len(job.keys):
        stats.drop("missing_image", missing)
    for reason, n in sorted(Counter(encoded.dropped.values()).items()):
        stats.drop(reason, n)
    kept = [i for i in range(len(job.keys)) if i not in encoded.dropped]
    latents = encoded.latents[kept]
    with atomic_path(root / source / STAGE / f"{job.shard}.npy") as tmp, open(tmp, "wb") as f:
        np.save(f, latents)
    stats.num_out = len(kept)
    as32 = latents.astype(np.float32)
    latent_keys.write(
        root, source, job.shard, [job.keys[i] for i in kept], [job.token_rows[i] for i in kept]
    )
    _remove_stale(root, source, job.shard, {f"{job.shard}.npy"}, before)
    stats.extra = {
        "model": model.name,
        "latent_mean": float(as32.mean()) if kept else None,
        "latent_std": float(as32.std()) if kept else None,
        "data_wait_seconds": round(encoded.data_wait_s, 3),
        "latent_spec": spec.to_dict(),
    }


def _commit_bucketed(
    root: Path,
    source: str,
    model: Model,
    spec: LatentSpec,
    encoded: Encoded,
    stats: ShardStats,
    before: bool,
):
    """`NNNNN.WxH.npy` per bucket present, then the keys file naming each row's bucket and row
    there; latent_mean/std are those of view 0's scaled mean (channels 0..3), as the legacy's."""
    job = encoded.job
    stats.num_in = job.num_in
    if missing := job.num_in - len(job.keys):
        stats.drop("missing_image", missing)
    for reason, n in sorted(Counter(job.dropped.values()).items()):
        stats.drop(reason, n)
    names = spec.plan.names()
    bucket_of = np.full(len(job.keys), -1, np.int64)
    bucket_row = np.full(len(job.keys), -1, np.int64)
    counts: dict[str, int] = {}
    total, sums = 0, np.zeros(2, np.float64)
    for bucket in sorted(encoded.parts):
        parts = encoded.parts[bucket]
        rows = np.concatenate([r for r, _ in parts])
        latents = np.concatenate([z for _, z in parts])
        bucket_of[rows] = bucket
        bucket_row[rows] = np.arange(len(rows))
        final = latent_keys.latents_path(root, source, job.shard, names[bucket])
        with atomic_path(final) as tmp, open(tmp, "wb") as f:
            np.save(f, latents)
        counts[names[bucket]] = len(rows)
        mean = latents[:, 0, :4].astype(np.float32)
        total += mean.size
        sums += (mean.sum(dtype=np.float64), np.square(mean, dtype=np.float64).sum())
    kept = np.flatnonzero(bucket_of >= 0)
    table = latent_keys.bucketed_table(
        [job.keys[i] for i in kept],
        [job.token_rows[i] for i in kept],
        [names[b] for b in bucket_of[kept]],
        bucket_row[kept],
        [job.sha256[i] for i in kept],
        latent_keys.tokens_path(root, source, job.shard),
        spec.to_dict(),
    )
    latent_keys.write_table(latent_keys.path(root, source, job.shard), table)
    _remove_stale(root, source, job.shard, {f"{job.shard}.{b}.npy" for b in counts}, before)
    stats.num_out = len(kept)
    mean = sums[0] / total if total else None
    stats.extra = {
        "model": model.name,
        "latent_mean": float(mean) if total else None,
        "latent_std": float(np.sqrt(max(0.0, sums[1] / total - mean**2))) if total else None,
        "data_wait_seconds": round(encoded.data_wait_s, 3),
        "latent_spec": spec.to_dict(),
        "buckets": counts,
    }


def finish_shard(root, source, model, spec, device, encoded: Encoded, stats: ShardStats) -> None:
    if encoded.job.error is not None:
        raise encoded.job.error
    if encoded.job.skip:  # its record was there when its inputs were read
        raise RuntimeError(f"encode: {stats.shard}'s record vanished while encoding")
    _commit(root, source, model, spec, encoded, stats)
    stats.extra["device"] = str(device)
