"""filter: DuckDB SQL generated from a filter profile, over metadata or over fetched shards.

Each row gets the first rule it fails (`reason`), in the fixed order of `rules()`, so the
counts per reason form the filter waterfall. Duplicates are judged among rows that pass every
other rule; the survivor of a duplicate group is the row with the smallest key.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import FilterProfile
from tasks.shards import ShardStats, atomic_path, run_shard, shard_name

ALL = "all"  # the shard name of a stage that runs as one unit over the whole source


def rules(profile: FilterProfile, *, has_sizes: bool = True) -> list[tuple[str, str]]:
    """(reason, SQL condition that drops the row), in waterfall order.

    A missing score fails its rule (it cannot be shown to pass); a missing or NaN size passes
    the metadata size rule because the size is checked again on the fetched pixels.
    """
    out = [("missing_url", "url IS NULL OR trim(url) = ''")] if has_sizes else []
    if profile.min_side:
        out.append(("too_small", f"coalesce(least(width, height) < {profile.min_side}, false)"))
    for column, op, value in (
        ("aesthetic", "<", profile.min_aesthetic),
        ("similarity", "<", profile.min_similarity),
        ("pwatermark", ">", profile.max_pwatermark),
        ("punsafe", ">", profile.max_punsafe),
    ):
        if value is not None:
            out.append((column, f"{column} IS NULL OR isnan({column}) OR {column} {op} {value}"))
    return out


def reason_sql(profile: FilterProfile, dedup: tuple[str, ...], *, has_sizes: bool = True) -> str:
    """A query over a relation `rows` adding a `reason` column (NULL = kept)."""
    cases = "\n".join(
        f"    WHEN {cond} THEN '{reason}'" for reason, cond in rules(profile, has_sizes=has_sizes)
    )
    sql = f"""
WITH ruled AS (
  SELECT *, CASE
{cases or "    WHEN false THEN ''"}
    ELSE NULL END AS reason
  FROM rows
)"""
    previous = "ruled"
    for column in dedup:
        sql += f""",
dedup_{column} AS (
  SELECT * REPLACE (CASE WHEN reason IS NULL AND
      row_number() OVER (PARTITION BY reason IS NULL, {column} ORDER BY key) > 1
      THEN 'duplicate_{column}' ELSE reason END AS reason)
  FROM {previous}
)"""
        previous = f"dedup_{column}"
    return sql + f"\nSELECT * FROM {previous} ORDER BY key"


def _write_shards(kept: pa.Table, out_dir: Path, samples_per_shard: int) -> int:
    """Split `kept` (ordered by key) into NNNNN.parquet shards; returns the shard count."""
    for old in out_dir.glob("[0-9]*.parquet"):
        old.unlink()
    num_shards = 0
    for start in range(0, kept.num_rows, samples_per_shard):
        with atomic_path(out_dir / f"{shard_name(num_shards)}.parquet") as tmp:
            pq.write_table(kept.slice(start, samples_per_shard), tmp)
        num_shards += 1
    return num_shards


def _apply(con: duckdb.DuckDBPyConnection, sql: str, stats: ShardStats) -> pa.Table:
    table = con.sql(sql).arrow()
    if hasattr(table, "read_all"):  # newer DuckDB returns a RecordBatchReader
        table = table.read_all()
    stats.num_in = table.num_rows
    reasons = table["reason"].to_pylist()
    for r in reasons:
        if r is not None:
            stats.drop(r)
    kept = table.filter(pa.compute.is_null(table["reason"])).drop_columns(["reason"])
    stats.num_out = kept.num_rows
    return kept


def filter_metadata(
    root: Path, source: str, profile: FilterProfile, samples_per_shard: int
) -> ShardStats:
    """Metadata rules + URL dedup over `metadata/*.parquet`; writes `filtered/NNNNN.parquet`."""
    out_dir = root / source / "filtered"

    def work(stats: ShardStats) -> None:
        con = duckdb.connect()
        files = sorted(str(p) for p in (root / source / "metadata").glob("*.parquet"))
        con.sql(f"CREATE VIEW rows AS SELECT * FROM read_parquet({files!r}, union_by_name=true)")
        dedup = tuple(c for c in profile.dedup if c == "url")
        kept = _apply(con, reason_sql(profile, dedup), stats)
        stats.extra = {
            "num_shards": _write_shards(kept, out_dir, samples_per_shard),
            "profile": profile.name,
        }

    return run_shard(root, source, "filtered", ALL, work)


def select_pixels(root: Path, source: str, profile: FilterProfile) -> ShardStats:
    """Rules on fetched pixels (actual size) + sha256 dedup across the whole source.

    Reads every `shards/NNNNN.parquet` (status `success` rows) and writes, per shard, the
    kept keys and captions to `selected/NNNNN.parquet`.
    """
    out_dir = root / source / "selected"

    def work(stats: ShardStats) -> None:
        tables = sorted((root / source / "shards").glob("[0-9]*.parquet"))
        stats.extra = {"num_shards": len(tables), "profile": profile.name}
        if not tables:  # the metadata filter dropped every row: nothing was fetched
            return
        con = duckdb.connect()
        con.sql(
            f"CREATE VIEW rows AS SELECT * FROM read_parquet({[str(p) for p in tables]!r}, "
            "filename=true) WHERE status = 'success'"
        )
        size_only = FilterProfile(name=profile.name, min_side=profile.min_side)
        dedup = tuple(c for c in profile.dedup if c == "sha256")
        kept = _apply(con, reason_sql(size_only, dedup, has_sizes=False), stats)
        for old in out_dir.glob("[0-9]*.parquet"):
            old.unlink()
        for path in tables:
            mine = kept.filter(pa.compute.equal(kept["filename"], str(path)))
            with atomic_path(out_dir / path.name) as tmp:
                pq.write_table(mine.select(["key", "caption"]), tmp)

    if out_dir.exists() and not (out_dir / f"{ALL}.stats.json").exists():
        shutil.rmtree(out_dir)  # a killed earlier run: start the unit over
    return run_shard(root, source, "selected", ALL, work)
