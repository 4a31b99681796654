"""Lineage over a data root: the rows a checkpoint trained on, the checkpoints that trained on
given URLs or keys (and at which step first), and those that trained on rows removed since.

Columnar and bounded: a checkpoint's rows are its segments replayed (`sdtrain.lineage.drawn`),
looked up in the run's copy of each set one record batch at a time; no Python object per row.
Removed rows are read from each source's `<root>/<source>/removals/blocklist.parquet` (its `key`
and `url` columns: every row a removal took out, `tasks.removal.lists`), not from the records.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain.atomic import write_json_atomic
from sdtrain.checkpoint import LINEAGE_FILE
from sdtrain.lineage import (
    Segment,
    bucket_codes,
    drawn,
    first_draws,
    read_segments,
    set_batches,
    set_copy,
)
from tasks.removal import lists

# <root>/<source>/removals/blocklist.parquet: key, url, hash, sha256 of every row removed
REMOVED = f"*/{lists.FOLDER}/{lists.BLOCKLIST}"
FLAGS = ".lineage-flags.json"  # under <root>/runs/: the last flags and what they were made of
SCHEMA = pa.schema(
    [
        ("set", pa.string()),
        ("row", pa.int64()),
        ("first_step", pa.int32()),
        ("source", pa.string()),
        ("key", pa.string()),
        ("url", pa.string()),
        ("caption", pa.string()),
        ("removed", pa.bool_()),
    ]
)


class LineageError(ValueError):
    """A checkpoint without lineage, or whose set's copy is gone."""


def checkpoints(root: Path) -> list[Path]:
    """Every checkpoint under `<root>/runs/`: step folders and final/, by run and step."""
    found = []
    for run in sorted(p for p in (Path(root) / "runs").glob("*") if p.is_dir()):
        found += sorted(p for p in (run / "checkpoints").glob("step-*") if p.is_dir())
        if (run / "final").is_dir():
            found.append(run / "final")
    return found


def run_dir_of(checkpoint: Path) -> Path:
    checkpoint = Path(checkpoint).resolve()
    return checkpoint.parent if checkpoint.name == "final" else checkpoint.parent.parent


def _segments(checkpoint: Path) -> list[Segment]:
    if not (Path(checkpoint) / LINEAGE_FILE).is_file():
        raise LineageError(
            f"{checkpoint}: no {LINEAGE_FILE} (not a checkpoint, or written before sdpipe "
            "recorded lineage)"
        )
    return read_segments(checkpoint)


def unrecorded_steps(checkpoint: Path) -> int:
    """Steps a checkpoint holds from before its run recorded lineage (resumed from an older
    sdpipe's checkpoint): their rows are unknown."""
    path = Path(checkpoint) / LINEAGE_FILE
    return json.loads(path.read_text()).get("unrecorded_steps", 0) if path.is_file() else 0


def _copy(checkpoint: Path, digest: str) -> Path:
    path = set_copy(run_dir_of(checkpoint), digest)
    if not path.is_file():
        raise LineageError(f"{checkpoint}: the rows of set {digest[:12]} are gone ({path})")
    return path


def _buckets(copy: Path, segment: Segment, cache: dict):
    if segment.sampler != "bucket":
        return None
    if copy not in cache:
        cache.clear()
        cache[copy] = bucket_codes(copy)
    return cache[copy]


def drawn_by_set(checkpoint: Path) -> list[tuple[str, Path, np.ndarray, np.ndarray]]:
    """(set digest, its copy, distinct rows sorted, first step of each) per set the checkpoint
    trained on, in the order first trained."""
    by_set: dict[str, list] = {}
    cache: dict = {}
    for segment in _segments(checkpoint):
        copy = _copy(checkpoint, segment.set)
        rows, steps = first_draws(segment, _buckets(copy, segment, cache), copy)
        by_set.setdefault(segment.set, [copy, [], []])
        by_set[segment.set][1].append(rows)
        by_set[segment.set][2].append(steps)
    out = []
    for digest, (copy, rows, steps) in by_set.items():
        rows, steps = np.concatenate(rows), np.concatenate(steps)
        order = np.lexsort((steps, rows))  # by row, its earliest step first
        rows, steps = rows[order], steps[order]
        first = np.ones(len(rows), bool)
        first[1:] = rows[1:] != rows[:-1]
        out.append((digest, copy, rows[first], steps[first]))
    return out


def removed_ids(root: Path) -> pa.Array:
    """Every key and URL of a row removed from a source of the data root (distinct strings)."""
    ids = [pa.array([], pa.string())]
    for blocklist in sorted(Path(root).glob(REMOVED)):
        table = pq.read_table(blocklist, columns=["key", "url"])
        ids += [pc.drop_null(c).combine_chunks() for c in table.columns]
    return pc.unique(pa.concat_arrays(ids))


def lineage_batches(checkpoint: Path, removed: pa.Array | None = None) -> Iterator[pa.RecordBatch]:
    """The rows a checkpoint trained on (`SCHEMA`), each set's in manifest order: set digest,
    row, the step it was first drawn for, source, key, url, caption, whether a removal lists it."""
    removed = removed if removed is not None else pa.array([], pa.string())
    for digest, copy, rows, steps in drawn_by_set(checkpoint):
        for start, batch in set_batches(copy, ["key", "source", "url", "caption"]):
            a, b = np.searchsorted(rows, [start, start + batch.num_rows])
            if a == b:
                continue
            taken = batch.take(pa.array(rows[a:b] - start))
            gone = pc.or_(
                pc.is_in(taken.column(0), value_set=removed),
                pc.fill_null(pc.is_in(taken.column(2), value_set=removed), False),
            )
            columns = [
                pa.DictionaryArray.from_arrays(
                    pa.array(np.zeros(b - a, np.int32)), pa.array([digest])
                ).dictionary_decode(),
                pa.array(rows[a:b].astype(np.int64)),
                pa.array(steps[a:b]),
                pc.cast(taken.column(1), pa.string()),  # a dictionary in the copy
                taken.column(0),
                taken.column(2),
                taken.column(3),
                gone,
            ]
            yield pa.record_batch(columns, schema=SCHEMA)


def write_lineage(checkpoint: Path, out: Path, removed: pa.Array | None = None) -> int:
    """The checkpoint's rows to a parquet file (temporary name, renamed); their number."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    num_rows = 0
    with pq.ParquetWriter(tmp, SCHEMA) as writer:
        for batch in lineage_batches(checkpoint, removed):
            writer.write_batch(batch)
            num_rows += batch.num_rows
    tmp.replace(out)
    return num_rows


def _matching_rows(copy: Path, urls: pa.Array, keys: pa.Array) -> np.ndarray:
    """Rows of a set's copy whose url is in `urls` or key in `keys` (sorted), batch by batch."""
    columns = [c for c, wanted in (("url", urls), ("key", keys)) if len(wanted)]
    found = []
    for start, batch in set_batches(copy, columns):
        hit = None
        for i, wanted in enumerate(w for w in (urls, keys) if len(w)):
            match = pc.fill_null(pc.is_in(batch.column(i), value_set=wanted), False)
            hit = match if hit is None else pc.or_(hit, match)
        found.append(np.flatnonzero(hit.to_numpy(zero_copy_only=False)) + start)
    return np.concatenate(found) if found else np.empty(0, np.int64)


def who_saw(root: Path, *, urls=(), keys=()) -> list[dict]:
    """Per checkpoint under `<root>/runs/` that trained on any of the URLs or keys: its phase
    (run), path, step, the step it first drew one, and how many of them it drew."""
    urls = pa.array(list(urls), pa.string()) if not isinstance(urls, pa.Array) else urls
    keys = pa.array(list(keys), pa.string()) if not isinstance(keys, pa.Array) else keys
    matched: dict[Path, np.ndarray] = {}
    cache: dict = {}
    out = []
    for checkpoint in checkpoints(root):
        try:
            segments = _segments(checkpoint)
        except LineageError:
            continue  # a checkpoint of an older sdpipe: nothing to tell
        first, seen = None, {}
        for segment in segments:
            copy = _copy(checkpoint, segment.set)
            if copy not in matched:  # a mask over the set's rows: a drawn row is one lookup
                found = _matching_rows(copy, urls, keys)
                matched[copy] = None
                if len(found):
                    matched[copy] = np.zeros(segment.num_rows, bool)
                    matched[copy][found] = True
            wanted = matched[copy]
            if wanted is None:
                continue
            rows, steps = drawn(segment, _buckets(copy, segment, cache), copy)
            hit = wanted[rows]
            if hit.any():
                step = int(steps[hit].min())
                first = step if first is None else min(first, step)
                seen.setdefault(segment.set, []).append(rows[hit])
        if first is not None:
            distinct = sum(len(np.unique(np.concatenate(parts))) for parts in seen.values())
            out.append(
                {
                    "phase": run_dir_of(checkpoint).name,
                    "checkpoint": str(checkpoint),
                    "step": _step_of(checkpoint),
                    "first_step": first,
                    "num_rows": distinct,
                }
            )
    return out


def _step_of(checkpoint: Path) -> int:
    """The optimizer steps a checkpoint holds: its last segment's end."""
    segments = read_segments(checkpoint)
    return segments[-1].last_step if segments else 0


def removed_flags(root: Path) -> list[dict]:
    """`who_saw` of every key and URL removed (`removed_ids`), remembered under
    `<root>/runs/` with the stats of what it was made of (blocklists, checkpoints)."""
    root = Path(root)
    records = sorted(root.glob(REMOVED))
    if not records:
        return []
    made_of = [
        [str(p), p.stat().st_mtime_ns, p.stat().st_size]
        for p in records + [c / LINEAGE_FILE for c in checkpoints(root)]
        if p.is_file()
    ]
    cached = root / "runs" / FLAGS
    try:
        remembered = json.loads(cached.read_text())
        if remembered["made_of"] == made_of:
            return remembered["flags"]
    except (OSError, ValueError, KeyError):
        pass
    ids = removed_ids(root)
    flags = who_saw(root, urls=ids, keys=ids)
    if (root / "runs").is_dir():
        write_json_atomic(cached, {"made_of": made_of, "flags": flags})
    return flags
