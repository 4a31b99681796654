"""hf export: a source's token shards as one Hugging Face `datasets` DatasetDict on disk.

`<root>/<source>/hf/` holds {train, validation} as written by `DatasetDict.save_to_disk`
(load it with `datasets.load_from_disk`): columns `key`, `caption` (the text that was
tokenized), `input_ids` (int32[77], SD1 CLIP ids) and `shard`, in shard and row order.

Design choices:
- The split is a function of (key, seed) alone: a key is in validation when the first 8
  bytes of blake2b(seed, key) read as a fraction are below `val_fraction`. So it is the same
  for any shard order or subset, and a key never moves split when shards are added.
- One unit of work (stage `hf`, shard `all`): every done token shard is read, one at a time,
  into an Arrow stream file per split, so memory holds one shard, not the source; the
  memory-mapped splits are then saved by `save_to_disk` into a hidden temporary folder under
  `<root>/<source>/` and exchanged with `hf/` in one rename. A killed run leaves only the
  hidden folder (removed by the next run) beside the `hf/` there before, never a half-written
  `hf/`; the stats record `hf/all.stats.json` is written after the rename and marks it done.
- Done while its inputs stand: the record keeps a digest of the done token shards, each by
  its tokens parquet's size and mtime_ns (one stat per shard, no token file read; a shard
  tokenized again is a new file renamed into place, as encode's keys files tell it too). A
  call whose digest differs (a shard added, gone or tokenized again) removes the record and
  exports again; the old `hf/` stays loadable until the new one replaces it. `selected/` is
  not in the digest: a re-selection that changes a shard's rows removes its tokens record
  first (tasks/curation/selection.py), so a done token shard's captions are those it was made
  of. A call with another seed or fraction fails instead (it would move keys between splits
  that a model may have trained or been evaluated on): remove `hf/` to split it again.
- A token row whose key has no row in `selected/` (the shard was re-selected after it was
  tokenized) is dropped as `missing_caption`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.atomic import TMP_MARK, clean_temporaries, replace_dir
from sdtrain.lazy import BUILD_LOCK
from tasks.latents.tokenize import STAGE as TOKENS
from tasks.latents.tokenize import clean_caption
from tasks.runtime.shards import (
    WHOLE_STAGE,
    ShardStats,
    done_record,
    run_shard,
    stage_dir,
    stats_path,
)

STAGE = "hf"
SPLITS = ("train", "validation")
log = logging.getLogger(__name__)


def in_validation(keys: list[str], seed: int, val_fraction: float) -> np.ndarray:
    """Per key: True when it belongs to the validation split (seeded, order-independent)."""
    salt = f"sdpipe-split:{seed}:".encode()
    limit = int(val_fraction * 2**64)
    return np.array(
        [
            int.from_bytes(hashlib.blake2b(salt + k.encode(), digest_size=8).digest(), "big")
            < limit
            for k in keys
        ],
        dtype=bool,
    )


def token_inputs(root: Path, source: str) -> dict[str, tuple[int, int]]:
    """Done token shards (a stats record, and its parquet there), in shard order: each
    parquet's (size, mtime_ns)."""
    d = stage_dir(root, source, TOKENS)
    inputs = {}
    for name in sorted(p.name.removesuffix(".stats.json") for p in d.glob("*.stats.json")):
        try:
            st = (d / f"{name}.parquet").stat()
        except FileNotFoundError:
            continue
        inputs[name] = (st.st_size, st.st_mtime_ns)
    return inputs


def inputs_digest(inputs: dict[str, tuple[int, int]]) -> str:
    return hashlib.blake2b(json.dumps(sorted(inputs.items())).encode(), digest_size=16).hexdigest()


def export_done(root: Path, source: str) -> bool:
    """The export is done (record there, outputs intact) and made from the token shards there
    now: the flow's check before it trusts a cached "done"."""
    record = done_record(root, source, STAGE, WHOLE_STAGE)
    digest = inputs_digest(token_inputs(root, source))
    return record is not None and record.extra.get("inputs") == digest


def _shard_rows(root: Path, source: str, shard: str, stats: ShardStats) -> pa.Table:
    tokens = pq.read_table(stage_dir(root, source, TOKENS) / f"{shard}.parquet")
    selected = pq.read_table(
        root / source / "selected" / f"{shard}.parquet", columns=["key", "caption"]
    )
    captions = {
        k: clean_caption(c)[0]
        for k, c in zip(selected["key"].to_pylist(), selected["caption"].to_pylist(), strict=True)
    }
    keys = tokens["key"].to_pylist()
    texts = [captions.get(k) for k in keys]
    keep = np.array([t is not None for t in texts], dtype=bool)
    stats.num_in += len(keys)
    if not keep.all():
        stats.drop("missing_caption", int((~keep).sum()))
        tokens = tokens.filter(pa.array(keep))
        texts = [t for t in texts if t is not None]
    return pa.table(
        {
            "key": tokens["key"],
            "caption": pa.array(texts, pa.string()),
            "input_ids": tokens["input_ids"],
            "shard": pa.array([shard] * tokens.num_rows, pa.string()),
        }
    )


def export_hf_dataset(
    root: Path, source: str, *, val_fraction: float = 0.01, seed: int = 0
) -> ShardStats:
    """Write `<root>/<source>/hf/` from every done token shard; skipped once done."""
    with BUILD_LOCK:  # its first import may reach transformers' lazy module
        import datasets

    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be within [0, 1], got {val_fraction}")
    source_dir = root / source
    final = stage_dir(root, source, STAGE)
    # Taken before any shard is read: a shard rewritten while the export reads it leaves a
    # digest that no longer matches, so the next call exports again.
    inputs = token_inputs(root, source)
    digest = inputs_digest(inputs)
    if (record := done_record(root, source, STAGE, WHOLE_STAGE)) is not None:
        asked = {"seed": seed, "val_fraction": val_fraction}
        made = {k: record.extra.get(k) for k in asked}
        if made != asked:
            raise ValueError(
                f"{final} was exported with {made}, not {asked}: remove it to export again"
            )
        if record.extra.get("inputs") != digest:
            log.warning(
                "hf-export %s: %s was not exported from the token shards there now (%d shards "
                "then, %d now): exporting again",
                source,
                final,
                record.extra.get("shards", 0),
                len(inputs),
            )
            stats_path(root, source, STAGE, WHOLE_STAGE).unlink()

    def work(stats: ShardStats) -> None:
        clean_temporaries(source_dir, f"{STAGE}.")
        tmp = source_dir / f".{STAGE}.work{TMP_MARK}{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            shards = list(inputs)
            counts = _write_split_streams(root, source, shards, tmp, stats, seed, val_fraction)
            splits = datasets.DatasetDict(
                {s: datasets.Dataset.from_file(str(tmp / f"{s}.arrow")) for s in SPLITS}
            )
            out = tmp / "dataset"
            # An empty split must be saved as one empty shard: datasets saves it as none,
            # and load_from_disk then fails.
            splits.save_to_disk(str(out), num_shards={s: 1 for s, n in counts.items() if not n})
            del splits  # the memory-mapped split files are removed with tmp
            stats.num_out = sum(counts.values())
            stats.extra.update(
                {
                    **counts,
                    "shards": len(shards),
                    "seed": seed,
                    "val_fraction": val_fraction,
                    "inputs": digest,
                }
            )
            # The old `hf/` (outdated, or a killed run's: no record) goes to `out`, then away.
            replace_dir(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return run_shard(root, source, STAGE, WHOLE_STAGE, work)


def _write_split_streams(
    root: Path,
    source: str,
    shards: list[str],
    tmp: Path,
    stats: ShardStats,
    seed: int,
    val_fraction: float,
) -> dict[str, int]:
    """Each shard's rows appended to `tmp/<split>.arrow` (Arrow stream files)."""
    schema = pa.schema(
        {
            "key": pa.string(),
            "caption": pa.string(),
            "input_ids": pa.list_(pa.int32(), 77),
            "shard": pa.string(),
        }
    )
    counts = dict.fromkeys(SPLITS, 0)
    writers = {s: pa.ipc.new_stream(str(tmp / f"{s}.arrow"), schema) for s in SPLITS}
    try:
        for shard in shards:
            rows = _shard_rows(root, source, shard, stats).cast(schema)
            val = in_validation(rows["key"].to_pylist(), seed, val_fraction)
            for split, mask in (("train", ~val), ("validation", val)):
                part = rows.filter(pa.array(mask))
                writers[split].write_table(part)
                counts[split] += part.num_rows
    finally:
        for w in writers.values():
            w.close()
    return counts
