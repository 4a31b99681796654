"""dedup: a profile's duplicate levels, judged among the rows that pass every rule.

Near (pHash) and semantic levels keep, in each group of duplicates, the best-ranked row
(`RANK_ORDER`), and drop a row only as a copy of a row that survives (`tasks.curation.survivors`).
Neither compares all pairs: pHash pairs come from sorted permuted prefixes
(`tasks.curation.phash_dedup`), embedding pairs from within k-means clusters
(`tasks.curation.semantic_dedup`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from catalog import FilterProfile
from tasks.curation import duck
from tasks.curation.phash_dedup import NearHashes
from tasks.curation.semantic_dedup import Parts, SemanticIndex

# One run's folder for the store, under a lease: a killed run's goes when its lease is over.
from tasks.curation.semantic_store import semantic_workdir as semantic_workdir

# A folder for semantic dedup's cluster-ordered store (a local disk: each round of the survivor
# rule reads it again); unset, the source's folder on the data root.
SEMANTIC_TEMP_ENV = "SDPIPE_SEMANTIC_TEMP"

PHASH_BATCH_ROWS = 1 << 18  # rows read from DuckDB at once into a partitioned pHash hook

# Survivor order of near and semantic duplicates: largest image, then highest aesthetic
# (NaN: unknown, last), then smallest key.
RANK_ORDER = (
    "CASE WHEN width > 0 AND height > 0 THEN width::DOUBLE * height END DESC NULLS LAST",
    "CASE WHEN isnan(aesthetic) THEN NULL ELSE aesthetic END DESC NULLS LAST",
    "key",
    "filename",
    "file_row_number",
)


class PhashLosers(Protocol):
    """How a pHash level finds its losers in place of `NearHashes` (the partitioned tasks,
    `tasks.curation.phash_partitioned.PartitionedLosers`), given its rows as batches from DuckDB
    (`hash` uint64, `rank` int64): the ranks that lose, as `NearHashes.losers`, range by range
    (`_phash_from_rows`); `summary()`: what its record keeps."""

    def from_rows(
        self, batches: Iterable[pa.RecordBatch], num_ranks: int, max_distance: int
    ) -> Iterator[np.ndarray]: ...

    def summary(self) -> dict: ...


class SemanticLosers(Protocol):
    """How a semantic level finds its losers in place of `SemanticIndex` (the partitioned
    tasks, `tasks.curation.semantic_partitioned.PartitionedSemantic`): bool [N] as
    `SemanticIndex(parts, rank, threshold, max_visits=max_visits).losers(include)` at the same
    centroids; `summary()`: what its record keeps."""

    def __call__(
        self,
        parts: Parts,
        rank: np.ndarray,
        threshold: float,
        max_visits: int,
        include: np.ndarray | None,
        device: str | torch.device | None = None,
    ) -> np.ndarray: ...

    def summary(self) -> dict: ...


def phash_losers(hashes: np.ndarray, rank: np.ndarray, max_distance: int) -> np.ndarray:
    """Rows dropped as near copies (within `max_distance` bits) of a surviving better-ranked
    row; bool [N] in input order. `hashes` uint64 [N], `rank` int64 [N] (unique; lower is
    better)."""
    return NearHashes(hashes, max_distance).losers(rank)


def semantic_losers(
    embeddings: np.ndarray,
    rank: np.ndarray,
    threshold: float,
    *,
    device: str | torch.device | None = None,
    num_clusters: int | None = None,
    max_visits: int = 2,
) -> np.ndarray:
    """Rows dropped as copies (embedding cosine >= `threshold`) of a surviving better-ranked
    row; bool [N]. Small inputs are compared all pairs; larger ones within k-means clusters."""
    parts = Parts.from_array(np.asarray(embeddings))
    index = SemanticIndex(
        parts, rank, threshold, device=device, num_clusters=num_clusters, max_visits=max_visits
    )
    return index.losers()


def _scalar(con: duckdb.DuckDBPyConnection, sql: str):
    return con.sql(sql).fetchall()[0][0]


def mark(
    con: duckdb.DuckDBPyConnection,
    profile: FilterProfile,
    level: str,
    scores_dir: Path | None,
    *,
    device: str | torch.device | None = None,
    notes: dict | None = None,
    phash: PhashLosers | None = None,
    semantic: SemanticLosers | None = None,
) -> tuple[int, int]:
    """Mark one level's duplicates among the still-kept rows of table `passing` (column `reason`
    NULL = kept); returns (alone: among all of them, removed: among the still-kept ones).
    `device`: where semantic similarities are computed (a GPU the caller holds a slot of).
    `notes` (semantic): gets `semantic_visits`; `semantic_beyond_visits`, the rows with a
    cluster within reach that they do not visit (only they can miss a duplicate); and from a
    sample of those (`semantic_sampled`), the ones that did (`semantic_missed_sample`) and the
    estimate over all (`semantic_missed_estimate`). `phash`: finds the pHash level's losers
    (default `NearHashes` in this process), `semantic`: the semantic level's (default
    `SemanticIndex` in this process; no missed-duplicate estimate); their summaries go to
    `notes["partitioned"]`."""
    reason = f"duplicate_{level}"
    if level in ("key", "url", "sha256"):
        order = "filename, file_row_number" if level == "key" else "key, filename, file_row_number"
        # Only the values held by more than one row matter: group once, then order the few
        # rows that hold them (a window over every row cost ~3x as much).
        con.sql(
            f"CREATE OR REPLACE TEMP TABLE repeated AS SELECT {level} AS value, "
            f"count(*) - 1 AS extra FROM passing WHERE {level} IS NOT NULL GROUP BY {level} "
            "HAVING count(*) > 1"
        )
        alone = int(_scalar(con, "SELECT coalesce(sum(extra), 0) FROM repeated"))
        if alone:
            con.sql(f"""
                UPDATE passing SET reason = '{reason}' WHERE rowid IN (
                    SELECT rowid FROM passing WHERE reason IS NULL
                    AND {level} IN (SELECT value FROM repeated)
                    QUALIFY row_number() OVER (PARTITION BY {level} ORDER BY {order}) > 1)
            """)
        con.sql("DROP TABLE repeated")
        if alone == 0:
            return 0, 0
    else:
        value = "phash" if level == "phash" else "key"
        # A row's position in survivor order is its rank.
        con.sql(
            f"CREATE OR REPLACE TEMP TABLE ranked AS SELECT rowid AS id, reason IS NULL AS kept, "
            f"{value} AS value, row_number() OVER (ORDER BY {', '.join(_rank_terms(con))}) - 1 "
            f"AS pos FROM passing WHERE {value} IS NOT NULL"
        )
        if level == "phash" and phash is not None:  # rows streamed to the partitioned tasks
            alone, lost = _phash_from_rows(con, phash, profile.phash_distance)
            if notes is not None:
                notes.setdefault("partitioned", {})["phash"] = phash.summary()
        else:
            alone, lost = _losers_in_arrays(
                con, profile, level, scores_dir, device, notes, semantic
            )
        con.sql("DROP TABLE ranked")
        if alone == 0:
            return 0, 0
        con.register("lost", pa.table({"id": lost}))
        con.sql(f"UPDATE passing SET reason = '{reason}' WHERE rowid IN (SELECT id FROM lost)")
        con.unregister("lost")
    removed = _scalar(con, f"SELECT count(*) FROM passing WHERE reason = '{reason}'")
    return alone, removed


def _losers_in_arrays(
    con: duckdb.DuckDBPyConnection,
    profile: FilterProfile,
    level: str,
    scores_dir: Path | None,
    device: str | torch.device | None,
    notes: dict | None,
    semantic: SemanticLosers | None,
) -> tuple[int, pa.Array]:
    """A level over table `ranked` in this process's arrays (one row each): the in-process
    pHash and semantic levels and the partitioned semantic hook; (alone, ids of the kept rows
    that lose)."""
    extra = ", value" if level == "phash" else ""
    rows = con.sql(f"SELECT id, kept{extra} FROM ranked ORDER BY pos").fetchnumpy()
    ids, kept = rows["id"], np.asarray(rows["kept"], bool)
    rank = np.arange(len(ids))
    if level == "phash":
        near = NearHashes(np.asarray(rows["value"], np.uint64), profile.phash_distance)
        alone, lost = int(near.losers(rank).sum()), near.losers(rank, kept)
    elif len(ids) and semantic is not None:
        parts, threshold = score_parts(con, scores_dir, len(ids)), profile.semantic_threshold
        visits = profile.semantic_visits
        alone = int(semantic(parts, rank, threshold, visits, None, device).sum())
        lost = np.zeros(len(ids), bool)
        if alone:  # losers among the kept rows: a run with the others absent
            lost = semantic(parts, rank, threshold, visits, kept, device)
        if notes is not None:
            notes["semantic_visits"] = visits
            notes.setdefault("partitioned", {})["semantic"] = semantic.summary()
    elif len(ids):
        # The cluster-ordered embeddings go to disk (SEMANTIC_TEMP_ENV), not to memory.
        with semantic_workdir(semantic_temp(scores_dir.parent)) as workdir:
            index = SemanticIndex(
                score_parts(con, scores_dir, len(ids)),
                rank,
                profile.semantic_threshold,
                device=device,
                max_visits=profile.semantic_visits,
                workdir=workdir,
            )
            alone, lost = int(index.losers().sum()), index.losers(kept)
            if notes is not None:
                missed = index.estimate_missed()
                notes["semantic_visits"] = profile.semantic_visits
                notes["semantic_beyond_visits"] = index.beyond_visits
                notes["semantic_sampled"] = missed.sampled
                notes["semantic_missed_sample"] = missed.missed_sample
                notes["semantic_missed_estimate"] = missed.estimated
            del index
    else:
        alone, lost = 0, kept
    return alone, pa.array(ids[lost], pa.int64())


def _phash_from_rows(
    con: duckdb.DuckDBPyConnection, phash: PhashLosers, distance: int
) -> tuple[int, pa.Array]:
    """The pHash level through the partitioned hook: table `ranked`'s rows stream to it from
    DuckDB, over every row and over the kept ones; (alone, ids of the kept rows that lose).
    This process holds a batch of rows and the ranks that lose, not an array per row."""

    def rows(where: str):
        sql = f"SELECT value AS hash, pos AS rank FROM ranked {where} ORDER BY pos"
        return duck.batches(con.sql(sql), PHASH_BATCH_ROWS)

    num = int(_scalar(con, "SELECT count(*) FROM ranked"))
    alone = sum(len(lost) for lost in phash.from_rows(rows(""), num, distance))
    kept = list(phash.from_rows(rows("WHERE kept"), num, distance)) if alone else []
    pos = np.concatenate(kept) if kept else np.zeros(0, np.int64)
    con.register("lost_pos", pa.table({"pos": pa.array(pos, pa.int64())}))
    lost = duck.to_arrow(con.sql("SELECT id FROM ranked JOIN lost_pos USING (pos)"))["id"]
    con.unregister("lost_pos")
    return alone, lost


def _rank_terms(con: duckdb.DuckDBPyConnection) -> list[str]:
    columns = {r[0] for r in con.sql("DESCRIBE passing").fetchall()}
    needs = (("width", "height"), ("aesthetic",), ("key",), ("filename",), ("file_row_number",))
    return [t for t, cols in zip(RANK_ORDER, needs, strict=True) if set(cols) <= columns]


def semantic_temp(source_dir: Path) -> Path:
    """Where semantic dedup's store goes: `SDPIPE_SEMANTIC_TEMP`, else `source_dir`."""
    folder = Path(os.environ.get(SEMANTIC_TEMP_ENV) or source_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def score_parts(con: duckdb.DuckDBPyConnection, scores_dir: Path, num_rows: int) -> Parts:
    """The embeddings of table `ranked`'s rows (row i: `pos` i), readable score shard by score
    shard: which shard row holds each key is found in DuckDB, and a part reads one shard."""
    files = sorted(scores_dir.glob("[0-9]*.parquet"))
    paths = [str(f) for f in files]
    con.register("score_files", pa.table({"file": np.arange(len(files)), "filename": paths}))
    located = con.sql(f"""
        SELECT r.pos, min((f.file::BIGINT << 32) | s.file_row_number) AS loc
        FROM read_parquet({paths!r}, filename=true, file_row_number=true) s
        JOIN score_files f USING (filename) JOIN ranked r ON r.value = s.key
        GROUP BY r.pos ORDER BY loc
    """).fetchnumpy()  # min(): a key scored twice is read once, from its first shard
    con.unregister("score_files")
    pos, at = np.asarray(located["pos"], np.int64), np.asarray(located["loc"], np.int64)
    if len(pos) != num_rows:
        raise AssertionError(f"{num_rows - len(pos)} of {num_rows} rows have no embedding")
    file, row = at >> 32, at & 0xFFFFFFFF
    starts = np.flatnonzero(np.diff(file, prepend=-1))
    ends = np.append(starts[1:], len(file))
    readers = [
        functools.partial(_read_embeddings, files[file[a]], row[a:b], pos[a:b])
        for a, b in zip(starts, ends, strict=True)
    ]
    dim = pq.read_schema(files[0]).field("embedding").type.list_size if files else 0
    return Parts(num_rows, dim, readers)


def _read_embeddings(
    path: Path, rows: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    column = pq.read_table(path, columns=["embedding"])["embedding"].combine_chunks()
    values = np.asarray(column.flatten()).reshape(len(column), column.type.list_size)
    return pos, values[rows]
