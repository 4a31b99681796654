"""What a checkpoint trained on: segments (phase set digest, sampler, step range, data positions),
from which the rows all ranks drew are derived by the samplers' own draw (`EpochSampler.
epoch_order`, `BucketBatchSampler.plan`), never stored per step. A run resumed on a re-mixed set
adds a segment. The set's rows (key, source, url, caption, bucket) are copied once per digest to
`<run_dir>/lineage/<digest>.arrow`: a re-mix replaces the phase folder, the copy stays.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain import layout
from sdtrain.atomic import atomic_path
from sdtrain.checkpoint import LINEAGE_FILE
from sdtrain.data import BucketBatchSampler, EpochSampler, split_rows

SETS = "lineage"  # `<run_dir>/lineage/<digest>.arrow`: a set's rows, manifest order
BATCH_ROWS = 1 << 20  # rows per record batch of a set's copy (what one read maps)
COLUMNS = ("key", "source", "url", "caption")
# A copy's buffers are zstd-compressed: a checkpoint's rows are scattered over every page of
# the set, so a listing reads the whole copy, and at 100M rows that is disk, not CPU (issue 36).
COPY_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")
SOURCE_TYPE = pa.dictionary(pa.int32(), pa.string())  # a few sources over many rows


def copy_schema(bucketed: bool) -> pa.Schema:
    fields = [pa.field(c, SOURCE_TYPE if c == "source" else pa.string()) for c in COLUMNS]
    if bucketed:
        fields.append(pa.field("bucket", pa.dictionary(pa.int32(), pa.string())))
    return pa.schema(fields)


def source_column(values: pa.Array, names: pa.Array) -> pa.DictionaryArray:
    """`values` (strings) as the copy's source column over the set's sorted source `names`: one
    dictionary for the whole file (the IPC file format keeps one per column)."""
    indices = pc.index_in(pc.cast(values, pa.string()), value_set=names)
    return pa.DictionaryArray.from_arrays(pc.cast(indices, pa.int32()), names)


@dataclass(kw_only=True, slots=True, frozen=True)
class Segment:
    """Optimizer steps (first_step, last_step] taken on one phase set by one sampler, from data
    position `start` to `end` ((epoch, done), done in the sampler's unit: run_data.py)."""

    set: str  # the set's manifest sha256
    phase_dir: str
    sampler: str  # "epoch" or "bucket"
    seed: int
    world_size: int
    batch_size: int
    grad_accum: int
    num_rows: int
    num_val: int
    first_step: int
    last_step: int
    start: tuple[int, int]
    end: tuple[int, int]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, data: dict) -> Segment:
        return cls(**{**data, "start": tuple(data["start"]), "end": tuple(data["end"])})

    def follows(self, earlier: Segment) -> bool:
        """Whether this one continues `earlier` with nothing changed (a resume on the same set)."""
        same = dataclasses.replace(earlier, first_step=self.first_step, last_step=self.last_step)
        return same == dataclasses.replace(self, start=earlier.start, end=earlier.end) and (
            earlier.last_step,
            earlier.end,
        ) == (self.first_step, self.start)


def extend(earlier: list[Segment], current: Segment) -> list[Segment]:
    """The segments of a checkpoint: those it resumed with, then the current one (merged into the
    last when it just continues it)."""
    if current.last_step == current.first_step:
        return list(earlier)
    if earlier and current.follows(earlier[-1]):
        last = earlier[-1]
        return [
            *earlier[:-1],
            dataclasses.replace(last, last_step=current.last_step, end=current.end),
        ]
    return [*earlier, current]


def read_segments(checkpoint: str | Path) -> list[Segment]:
    """A checkpoint's segments ([] for one written before sdpipe recorded them)."""
    path = Path(checkpoint) / LINEAGE_FILE
    if not path.is_file():
        return []
    return [Segment.of(s) for s in json.loads(path.read_text())["segments"]]


def segments_json(segments: list[Segment], unrecorded_steps: int = 0) -> str:
    """`unrecorded_steps`: the first steps, trained before the run recorded lineage."""
    data = {"segments": [s.to_json() for s in segments]}
    return json.dumps({**data, "unrecorded_steps": unrecorded_steps} if unrecorded_steps else data)


def set_copy(run_dir: str | Path, digest: str) -> Path:
    return Path(run_dir) / SETS / f"{digest}.arrow"


def keep_set(phase_dir: str | Path, run_dir: str | Path, digest: str, buckets=None) -> Path:
    """`<run_dir>/lineage/<digest>.arrow` unless there: the set's key, source, url and caption
    per manifest row (url and caption from the source's sample tables `<root>/<source>/shards/
    <shard>.parquet`, null where none), and `bucket` (dictionary: the trainer's row buckets,
    `buckets` = (codes, names)) for a bucketed set. Written batch by batch, renamed into place."""
    out = set_copy(run_dir, digest)
    if out.is_file():
        return out
    phase_dir = Path(phase_dir)
    root = phase_dir.parent.parent
    manifest = pq.ParquetFile(phase_dir / layout.MANIFEST)
    schema = copy_schema(buckets is not None)
    names = set()
    for batch in manifest.iter_batches(BATCH_ROWS, columns=["source"]):
        names.update(pc.unique(pc.cast(batch.column(0), pa.string())).to_pylist())
    names = pa.array(sorted(names), pa.string())
    samples = _SampleTables(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        atomic_path(out) as tmp,
        pa.OSFile(str(tmp), "wb") as sink,
        pa.ipc.new_file(sink, schema, options=COPY_OPTIONS) as writer,
    ):
        start = 0
        for batch in manifest.iter_batches(BATCH_ROWS, columns=["key", "source", "shard"]):
            table = pa.Table.from_batches([batch])
            url, caption = samples.lookup(table)
            columns = [
                pc.cast(table["key"], pa.string()),
                source_column(table["source"], names),
                url,
                caption,
            ]
            if buckets is not None:
                codes, names = buckets
                indices = pa.array(np.asarray(codes[start : start + len(table)], np.int32))
                columns.append(pa.DictionaryArray.from_arrays(indices, pa.array(names)))
            writer.write_table(pa.table(columns, schema=schema), max_chunksize=BATCH_ROWS)
            start += len(table)
    return out


class _SampleTables:
    """url and caption by key from `<root>/<source>/shards/<shard>.parquet`, one shard held at a
    time (a manifest's rows come in runs of a shard)."""

    def __init__(self, root: Path):
        self.root, self.held = root, (None, None)

    def _table(self, source: str, shard: str) -> pa.Table | None:
        if self.held[0] != (source, shard):
            path = self.root / source / "shards" / f"{shard}.parquet"
            table = None
            if path.is_file():
                have = pq.read_schema(path).names
                wanted = [c for c in ("key", "url", "caption") if c in have]
                table = pq.read_table(path, columns=wanted) if "key" in wanted else None
            self.held = ((source, shard), table)
        return self.held[1]

    def lookup(self, table: pa.Table) -> tuple[pa.Array, pa.Array]:
        pair = pc.binary_join_element_wise(
            pc.cast(table["source"], pa.string()), pc.cast(table["shard"], pa.string()), "\x00"
        )
        names, codes = layout.column_codes(pair)
        parts_url, parts_caption, parts_rows = [], [], []
        keys = pc.cast(table["key"], pa.string()).combine_chunks()
        for code, name in enumerate(names):
            rows = np.flatnonzero(codes == code)
            samples = self._table(*name.split("\x00"))
            wanted = keys.take(pa.array(rows))
            where = None if samples is None else pc.index_in(wanted, value_set=samples["key"])
            for column, parts in (("url", parts_url), ("caption", parts_caption)):
                if samples is None or column not in samples.column_names:
                    parts.append(pa.nulls(len(rows), pa.string()))
                else:
                    taken = samples[column].combine_chunks().take(where)
                    parts.append(pc.cast(taken, pa.string()))
            parts_rows.append(rows)
        inverse = np.empty(len(table), np.int64)
        inverse[np.concatenate(parts_rows) if parts_rows else []] = np.arange(len(table))
        order = pa.array(inverse)
        return (
            pa.concat_arrays(parts_url or [pa.nulls(0, pa.string())]).take(order),
            pa.concat_arrays(parts_caption or [pa.nulls(0, pa.string())]).take(order),
        )


# ---- the draw, replayed -------------------------------------------------------------------------


def held_out_path(copy: Path, seed: int, num_val: int) -> Path:
    """The rows the trainer held out for validation (`split_rows`), kept beside the set's copy:
    at 100M rows the split's full permutation is ~13 s of a listing, the mask of them ~0.3 s."""
    return Path(copy).with_name(f"{Path(copy).stem}.held-out-{seed}-{num_val}.npy")


def keep_held_out(copy: Path, seed: int, val_rows: np.ndarray) -> None:
    path = held_out_path(copy, seed, len(val_rows))
    if not path.is_file():
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.save(f, np.asarray(val_rows, np.int64))


@functools.lru_cache(maxsize=1)
def _training_rows(num_rows: int, num_val: int, seed: int, held_out: str = "") -> np.ndarray:
    """The trainer's training rows (`split_rows`), int32 where they fit (cached: the checkpoints of
    one run share them); from the held-out rows the trainer kept (`held_out`) where there."""
    val = np.load(held_out) if held_out and Path(held_out).is_file() else None
    if val is not None and len(val) == num_val:
        training = np.ones(num_rows, bool)
        training[val] = False
        rows = np.flatnonzero(training)
    else:
        rows, _ = split_rows(num_rows, num_val, seed)
    return rows.astype(np.int32) if num_rows < 2**31 else rows


def _rows_of(segment: Segment, copy: Path | None) -> np.ndarray:
    held_out = held_out_path(copy, segment.seed, segment.num_val) if copy is not None else ""
    return _training_rows(segment.num_rows, segment.num_val, segment.seed, str(held_out))


_SAMPLER: dict = {}  # the last sampler rebuilt: the checkpoints of one run share it


def _sampler(segment: Segment, buckets=None, copy: Path | None = None):
    """The segment's sampler as rank 0 built it (its set's buckets a function of the set)."""
    key = dataclasses.replace(
        segment, phase_dir="", first_step=0, last_step=0, start=(0, 0), end=(0, 0), grad_accum=0
    )
    if key not in _SAMPLER:
        _SAMPLER.clear()
        _ORDERS.clear()
        rows = _rows_of(segment, copy)
        if segment.sampler == "bucket":
            codes, names = buckets
            _SAMPLER[key] = BucketBatchSampler(
                rows,
                np.asarray(codes)[rows],
                names,
                batch_size=segment.batch_size,
                seed=segment.seed,
                world_size=segment.world_size,
            )
        else:
            _SAMPLER[key] = EpochSampler(
                len(rows), seed=segment.seed, world_size=segment.world_size
            )
    return _SAMPLER[key]


_ORDERS: dict = {}  # (sampler, epoch) -> order: the checkpoints of a run replay the same epochs
ORDERS_BYTES = 1 << 30  # what the kept epoch orders may hold


def _epoch_order(sampler: EpochSampler, epoch: int) -> np.ndarray:
    key = (id(sampler), epoch)
    if key not in _ORDERS:
        order = sampler.epoch_order(epoch).numpy()
        if any(k[0] != id(sampler) for k in _ORDERS):
            _ORDERS.clear()
        while _ORDERS and (len(_ORDERS) + 1) * order.nbytes > ORDERS_BYTES:
            del _ORDERS[next(iter(_ORDERS))]  # the oldest
        _ORDERS[key] = order
    return _ORDERS[key]


def _micro_batches(segment: Segment, sampler, epoch: int, a: int, b: int, copy: Path | None):
    """(manifest rows, micro-batch sizes) of micro-batches [a, b) of an epoch, all ranks'."""
    if segment.sampler == "bucket":
        order, starts, sizes = sampler.plan(epoch)
        starts, sizes = starts[a:b], sizes[a:b]
        # Each batch's slice of `order`, vectorised: a start per row plus its place in the batch.
        first = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
        return order[first + np.arange(int(sizes.sum()))], sizes
    per = segment.batch_size * segment.world_size
    order = _epoch_order(sampler, epoch)[a * per : b * per]
    return _rows_of(segment, copy)[order], np.full(b - a, per)


def drawn(
    segment: Segment, buckets=None, copy: Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(manifest rows, the optimizer step each was drawn for) of every micro-batch all ranks read
    in the segment, in the order read: the trainer's samplers replayed from `start` to `end`.
    `buckets` = (codes per manifest row, bucket names) for a bucketed segment."""
    sampler = _sampler(segment, buckets, copy)
    if segment.sampler == "bucket":
        per_epoch, unit = sampler.num_batches, 1
    else:
        per_epoch, unit = sampler.num_per_rank // segment.batch_size, segment.batch_size
        unit *= segment.world_size
    rows, steps, done = [], [], 0
    for epoch in range(segment.start[0], segment.end[0] + 1):
        a = segment.start[1] // unit if epoch == segment.start[0] else 0
        b = segment.end[1] // unit if epoch == segment.end[0] else per_epoch
        a, b = min(a, per_epoch), min(b, per_epoch)
        if b <= a:
            continue
        part, sizes = _micro_batches(segment, sampler, epoch, a, b, copy)
        step = segment.first_step + (done + np.arange(b - a)) // segment.grad_accum + 1
        rows.append(part)
        steps.append(np.repeat(step.astype(np.int32), sizes))
        done += b - a
    if done != (segment.last_step - segment.first_step) * segment.grad_accum:
        raise ValueError(
            f"lineage segment of steps {segment.first_step}-{segment.last_step}: positions "
            f"{segment.start} -> {segment.end} give {done} micro-batches, not "
            f"{segment.last_step - segment.first_step} steps x grad_accum {segment.grad_accum}"
        )
    if not rows:
        return np.empty(0, np.int64), np.empty(0, np.int32)
    return np.concatenate(rows), np.concatenate(steps)


def first_draws(
    segment: Segment, buckets=None, copy: Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(distinct manifest rows sorted, the step each was first drawn for) of a segment."""
    rows, steps = drawn(segment, buckets, copy)
    unique, first = np.unique(rows, return_index=True)  # first: the earliest place, in draw order
    return unique, steps[first]


def set_batches(path: Path, columns: list[str]) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row, batch of `columns`) of a set's copy, each batch mapped and let go on its own:
    what a query touches of a 100M-row file stays one batch's pages. Only `columns` are read
    (and decompressed)."""
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        num_batches, names = reader.num_record_batches, reader.schema.names
    fields = [names.index(c) for c in columns] if columns else None
    options = pa.ipc.IpcReadOptions(included_fields=sorted(fields) if fields else None)
    start = 0
    for i in range(num_batches):
        with pa.memory_map(str(path)) as source:
            batch = pa.ipc.open_file(source, options=options).get_batch(i)
            batch = batch.select(columns) if columns else batch
            length = batch.num_rows
            yield start, batch
            del batch
        start += length


def bucket_codes(path: Path) -> tuple[np.ndarray, list[str]] | None:
    """(int32 code per row, names) of a copy's `bucket` column, None for an unbucketed set."""
    if "bucket" not in pa.ipc.open_file(pa.memory_map(str(path))).schema.names:
        return None
    codes, names = [], None
    for _, batch in set_batches(path, ["bucket"]):
        column = batch.column(0)
        names = column.dictionary.to_pylist() if names is None else names
        codes.append(column.indices.to_numpy(zero_copy_only=False).astype(np.int32))
    return np.concatenate(codes), names or []


class RunLineage:
    """A run's segments: those of the checkpoint it resumed from, then its own, from where it
    began to where a checkpoint is written. None for a run not on a phase set (a fine-tune)."""

    def __init__(self, config, data, *, digest: str, world_size: int, resume_from, position):
        from sdtrain.data import PhaseSet

        self.run_dir, self.phase_dir = config.run_dir, config.phase_dir
        self.earlier = read_segments(resume_from) if resume_from else []
        self.unrecorded = 0  # steps of a checkpoint written before lineage was recorded
        if resume_from:
            path = Path(resume_from) / LINEAGE_FILE
            recorded = json.loads(path.read_text()) if path.is_file() else None
            self.unrecorded = (
                position[0] if recorded is None else recorded.get("unrecorded_steps", 0)
            )
        self.dataset = data.dataset if isinstance(data.dataset, PhaseSet) else None
        self.val_rows = data.val_rows
        step, epoch, done = position
        self.current = Segment(
            set=digest,
            phase_dir=str(config.phase_dir),
            sampler="bucket" if data.bucketed else "epoch",
            seed=config.seed,
            world_size=world_size,
            batch_size=config.batch_size,
            grad_accum=config.grad_accum,
            num_rows=len(data.dataset),
            num_val=config.num_val_samples,
            first_step=step,
            last_step=step,
            start=(epoch, done),
            end=(epoch, done),
        )

    def at(self, step: int, epoch: int, done: int) -> str | None:
        """The segments of a checkpoint at this position (JSON), the set's copy kept first."""
        if self.dataset is None:
            return None
        buckets = None
        if self.current.sampler == "bucket":
            buckets = (self.dataset.bucket_of_row, self.dataset.bucket_names)
        copy = keep_set(self.phase_dir, self.run_dir, self.current.set, buckets)
        keep_held_out(copy, self.current.seed, self.val_rows)
        current = dataclasses.replace(self.current, last_step=step, end=(epoch, done))
        return segments_json(extend(self.earlier, current), self.unrecorded)
