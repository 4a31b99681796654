"""DuckDB sessions of the filter stages: memory capped, spilling under the data root.

DuckDB's defaults (80% of RAM, spill files in `.tmp` of the working directory) fail or fill
the wrong disk on Re-LAION-2B-scale metadata (~2.3B rows, far more than memory): a session
gets `SDPIPE_DUCKDB_MEMORY` (default half the RAM: the stage's arrays and other stages share
the machine) and spills to `SDPIPE_DUCKDB_TEMP` (default `<data root>/.tmp/duckdb`).
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.atomic import atomic_path
from tasks.runtime.shards import shard_name

MEMORY_ENV, TEMP_ENV = "SDPIPE_DUCKDB_MEMORY", "SDPIPE_DUCKDB_TEMP"
# Spill space per uncompressed input byte: the passing rows as a table, and the key-ordered
# sort of the kept ones beside it (measured: see docs/benchmarks.md, filter --memory-limit).
SPILL_PER_INPUT_BYTE = 2.0
log = logging.getLogger("sdpipe.filter")


class SpillError(RuntimeError):
    """A filter stage ran out of memory or spill space: says the settings and the need."""


def memory_limit() -> str:
    """`SDPIPE_DUCKDB_MEMORY` (a DuckDB size: "8GB", "500MiB"), else half the RAM."""
    if value := os.environ.get(MEMORY_ENV):
        return value
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{max(64, ram // 2 // 2**20)}MiB"


def temp_directory(root: Path) -> Path:
    return Path(os.environ.get(TEMP_ENV) or root / ".tmp" / "duckdb")


def connect(root: Path | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection for judging rows, its memory capped; with `root`, spilling under it.

    Parquet writers leave NaN out of a column's min/max statistics, and DuckDB's statistics
    propagation then folds `score <= 10` (and `isnan(score)`) to constants, passing NaN scores;
    that optimizer is off here. The cost measured on 10M rows: none.

    The allocator returns freed memory to the system from a background thread rather than
    from the scan's threads (10M rows, alternating side by side, three runs of 5-10 each: best
    1.52-1.57 s against 1.60-1.66 s, medians 1.62-1.66 s against 1.69-1.74 s).
    """
    con = duckdb.connect()
    con.sql("SET disabled_optimizers = 'statistics_propagation'")
    con.sql("SET allocator_background_threads = true")
    con.sql(f"SET memory_limit = '{memory_limit()}'")
    if root is not None:
        temp = temp_directory(root)
        temp.mkdir(parents=True, exist_ok=True)
        con.sql(f"SET temp_directory = '{temp}'")  # DuckDB names its files by process
    return con


def batches(relation: duckdb.DuckDBPyRelation, rows: int) -> pa.RecordBatchReader:
    """The relation's rows as a reader of batches of `rows`, streamed out of DuckDB."""
    if hasattr(relation, "to_arrow_reader"):  # DuckDB 2 renamed it
        return relation.to_arrow_reader(rows)
    return relation.fetch_record_batch(rows)


def to_arrow(relation: duckdb.DuckDBPyRelation) -> pa.Table:
    table = relation.arrow()
    return table.read_all() if hasattr(table, "read_all") else table  # newer DuckDB: a reader


def human(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"


@dataclass(frozen=True, slots=True)
class SpillPlan:
    """What a session over some parquet files may spill, and where."""

    memory_limit: str
    temp_directory: str
    input_bytes: int  # the files' uncompressed size
    spill_estimate_bytes: int
    temp_free_bytes: int

    def record(self) -> dict:
        return asdict(self)

    def error(self, exc: Exception) -> SpillError:
        disk = isinstance(exc, duckdb.IOException) or "temp_directory" in str(exc)
        return SpillError(
            f"DuckDB ran out of {'disk' if disk else 'memory'} ({exc}). Memory limit "
            f"{self.memory_limit} ({MEMORY_ENV}); spill folder {self.temp_directory} "
            f"({TEMP_ENV}) had {human(self.temp_free_bytes)} free; this input "
            f"({human(self.input_bytes)} uncompressed) may need up to "
            f"{human(self.spill_estimate_bytes)} there."
        )


def input_bytes(files: list[Path]) -> int:
    """The files' uncompressed size: their row groups' sizes from the footers."""
    return sum(
        meta.row_group(i).total_byte_size
        for meta in (pq.read_metadata(f) for f in files)
        for i in range(meta.num_row_groups)
    )


def spill_plan(root: Path, files: list[Path]) -> SpillPlan:
    """The spill estimate of a session reading `files`, logged (a warning when the spill
    folder's disk has less free): row groups' uncompressed sizes from the footers."""
    size = input_bytes(files)
    temp = temp_directory(root)
    temp.mkdir(parents=True, exist_ok=True)
    plan = SpillPlan(
        memory_limit=memory_limit(),
        temp_directory=str(temp),
        input_bytes=size,
        spill_estimate_bytes=round(SPILL_PER_INPUT_BYTE * size),
        temp_free_bytes=shutil.disk_usage(temp).free,
    )
    short = plan.temp_free_bytes < plan.spill_estimate_bytes
    log.log(
        logging.WARNING if short else logging.INFO,
        "DuckDB: memory limit %s, spill folder %s (%s free); input %s uncompressed, spilling "
        "may need up to %s",
        plan.memory_limit,
        plan.temp_directory,
        human(plan.temp_free_bytes),
        human(plan.input_bytes),
        human(plan.spill_estimate_bytes),
    )
    return plan


def read_files(files: list[Path]) -> str:
    """SQL reading `files` as one relation, with where each row was read (`POSITION`).

    Columns are matched by name across files only when their schemas differ: DuckDB's
    `union_by_name` reads every file's footer each time a query binds, 0.25-0.3 s per query
    over 4,000 shards, where one pass over the schemas here costs 0.4 s once.
    """
    schemas = {pq.read_schema(f).remove_metadata() for f in files}
    union = "union_by_name=true, " if len(schemas) > 1 else ""
    paths = [str(f) for f in files]
    return f"read_parquet({paths!r}, {union}filename=true, file_row_number=true)"


def write_shard(part: pa.Table, path: Path) -> None:
    """One filtered shard as the stage writes it (the partitioned path writes the same bytes)."""
    # Keys, URLs and captions are (nearly) unique: a dictionary attempt on them is wasted work.
    dictionary = [c for c in ("source",) if c in part.schema.names]
    pq.write_table(part, path, use_dictionary=dictionary)


def write_shards(kept: duckdb.DuckDBPyRelation, out_dir: Path, samples_per_shard: int) -> int:
    """Write `kept` (ordered by key) as NNNNN.parquet shards as it streams out of DuckDB;
    returns the shard count. Memory holds the shards being written, never the whole output."""
    for old in out_dir.glob("[0-9]*.parquet"):
        old.unlink()
    reader = batches(kept, samples_per_shard)

    def write(index: int, part: pa.Table) -> None:
        with atomic_path(out_dir / f"{shard_name(index)}.parquet") as tmp:
            write_shard(part, tmp)

    def shards() -> Iterator[pa.Table]:
        """`samples_per_shard` rows at a time (the last shard shorter), in order."""
        buffered, rows = [], 0
        for batch in reader:
            buffered.append(batch)
            rows += len(batch)
            while rows >= samples_per_shard:
                table = pa.Table.from_batches(buffered, reader.schema)
                yield table.slice(0, samples_per_shard)
                rest = table.slice(samples_per_shard)
                buffered, rows = rest.to_batches(), len(rest)
        if rows:
            yield pa.Table.from_batches(buffered, reader.schema)

    # Encoding and compressing a shard holds no GIL: one writer per core, as many in flight.
    workers = os.cpu_count() or 1
    pending: collections.deque = collections.deque()
    num_shards = 0
    with ThreadPoolExecutor(workers) as pool:
        for part in shards():
            pending.append(pool.submit(write, num_shards, part))
            num_shards += 1
            if len(pending) > workers:
                pending.popleft().result()
        for future in pending:
            future.result()
    return num_shards
