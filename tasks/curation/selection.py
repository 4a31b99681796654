"""filter-pixels' selection on disk: `selected/NNNNN.parquet` per fetched shard, keyed by the
scorer whose scores chose it, and what was built from it kept in step.

A selection chosen from another scorer's scores (a re-score: other weights or settings) is
made again, as score's own records are (`tasks.curation.score.shard_done`); a shard scored
again also removes the selection's record (`forget`), which catches a selection recorded
before identities were. A shard whose kept rows change forgets the per-shard stages built from
its old rows (tokens, latents: their records go, so they run again) before its new rows are
written: at any moment a selection file differs from what its tokens were built from only if
their record is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.atomic import atomic_path
from tasks.runtime.shards import WHOLE_STAGE, ShardStats, done_record, stats_path

STAGE = "selected"
BUILT_FROM_SHARD = ("tokens", "latents")  # per shard, from its selection file
log = logging.getLogger(__name__)


def _chosen_by(record: ShardStats, identity: dict | None) -> bool:
    recorded = record.extra.get("scorer_identity")
    # Unscored, or selected before identities were recorded (check_profile keeps its scorer's
    # name the same): it stands.
    return identity is None or recorded is None or recorded == identity


def selection_done(root: Path, source: str, identity: dict | None) -> bool:
    """The selection's record is there, its outputs intact, and it was chosen from the scores
    of `identity`'s scorer (`score.scorer_identity`; None: unscored)."""
    record = done_record(root, source, STAGE, WHOLE_STAGE)
    return record is not None and _chosen_by(record, identity)


def forget(root: Path, source: str) -> None:
    """The selection's record goes: a shard's scores are being made again (by another scorer),
    so it is chosen again from them (a record from before identities were kept, too)."""
    stats_path(root, source, STAGE, WHOLE_STAGE).unlink(missing_ok=True)


def forget_other_scorer(root: Path, source: str, identity: dict | None) -> None:
    """A selection chosen from another scorer's scores loses its record (with a warning), so it
    is made again from the scores there now."""
    path = stats_path(root, source, STAGE, WHOLE_STAGE)
    try:
        record = ShardStats.read(path)
    except FileNotFoundError:
        return
    if not _chosen_by(record, identity):
        log.warning(
            "filter-pixels %s: chosen from another scorer's scores (%s); selecting again",
            source,
            record.extra.get("scorer_identity", {}).get("model"),
        )
        path.unlink(missing_ok=True)


def write_shards(
    root: Path, source: str, kept: pa.RecordBatchReader | pa.Table, shards: list[Path]
) -> int:
    """Each fetched shard's kept rows (`kept`: key, caption, filename, in filename order, as
    batches read one at a time: a shard's rows at most are held) to
    `selected/<shard>.parquet` (key, caption), a file for every shard, none for others. Returns
    how many shards whose rows changed had tokens or latents built from them (forgotten first).
    """
    out_dir = root / source / STAGE
    if isinstance(kept, pa.Table):
        kept = pa.RecordBatchReader.from_batches(kept.schema, kept.to_batches())
    by_name = {str(p): p for p in shards}
    out_dir.mkdir(parents=True, exist_ok=True)
    names = {p.name for p in shards}
    for old in out_dir.glob("[0-9]*.parquet"):
        if old.name not in names:
            _forget_built_from(root, source, old.stem)
            old.unlink()
    schema = pa.schema([kept.schema.field("key"), kept.schema.field("caption")])
    written: set[str] = set()
    num_changed = 0
    for filename, rows in _shard_runs(kept, schema):
        if filename not in by_name:  # a kept row would be written to no shard
            raise AssertionError(f"kept rows from a file not listed as a shard: {filename}")
        if filename in written:
            raise AssertionError(f"kept rows not in filename order: {filename} twice")
        written.add(filename)
        num_changed += _write(root, source, out_dir / by_name[filename].name, rows)
    for name, path in by_name.items():
        if name not in written:  # a shard that keeps nothing still has its (empty) file
            num_changed += _write(root, source, out_dir / path.name, schema.empty_table())
    if num_changed:
        log.warning(
            "filter-pixels %s: %d shard(s) now keep other rows; their %s run again",
            source,
            num_changed,
            " and ".join(BUILT_FROM_SHARD),
        )
    return num_changed


def _write(root: Path, source: str, path: Path, rows: pa.Table) -> int:
    """A shard's selection file; 1 if its rows changed and something built from it was
    forgotten."""
    changed = 0 if _same_rows(path, rows) else _forget_built_from(root, source, path.stem)
    with atomic_path(path) as tmp:
        pq.write_table(rows, tmp)
    return changed


def _same_rows(path: Path, rows: pa.Table) -> bool:
    try:
        before = pq.read_table(path, columns=rows.column_names)
    except (OSError, KeyError, pa.ArrowException):  # none, or not a selection file we read
        return False
    return before.schema.equals(rows.schema) and before.equals(rows)


def _forget_built_from(root: Path, source: str, shard: str) -> int:
    """1 if a stage built from the shard's selection had a record (now removed), else 0."""
    forgotten = 0
    for stage in BUILT_FROM_SHARD:
        path = stats_path(root, source, stage, shard)
        if path.exists():
            path.unlink(missing_ok=True)
            forgotten = 1
    return forgotten


def _shard_runs(batches: pa.RecordBatchReader, schema: pa.Schema) -> Iterator[tuple[str, pa.Table]]:
    """(filename, its rows as `schema`) for each run of one filename in `batches`, in order:
    one pass over each batch's filename column, a run's pieces joined when it ends (a filter
    per shard compared every kept row once per shard: shards x rows, hours at LAION scale)."""
    name, pieces = None, []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        encoded = batch.column("filename").dictionary_encode()
        codes = encoded.indices.to_numpy(zero_copy_only=False)
        values = encoded.dictionary.to_pylist()
        starts = np.flatnonzero(np.concatenate([[True], codes[1:] != codes[:-1]]))
        ends = np.append(starts[1:], len(codes))
        rows = pa.Table.from_batches([batch]).select(schema.names).cast(schema)
        for a, b in zip(starts, ends, strict=True):
            value = values[codes[a]]
            if value != name:
                if pieces:
                    yield name, pa.concat_tables(pieces).combine_chunks()
                name, pieces = value, []
            pieces.append(rows.slice(int(a), int(b - a)))
    if pieces:
        yield name, pa.concat_tables(pieces).combine_chunks()
