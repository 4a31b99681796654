"""dedup: a profile's duplicate levels, judged among the rows that pass every rule.

Near (pHash) and semantic levels drop a row when a better-ranked row (`RANK_ORDER`) is its
duplicate, so no two survivors are duplicates. pHashes within k bits agree on one of k + 1
bands (pigeonhole): candidates come from k + 1 equality joins, never from all pairs.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from catalog import FilterProfile

# Survivor order of near and semantic duplicates: largest image, then highest aesthetic
# (NaN: unknown, last), then smallest key.
RANK_ORDER = (
    "CASE WHEN width > 0 AND height > 0 THEN width::DOUBLE * height END DESC NULLS LAST",
    "CASE WHEN isnan(aesthetic) THEN NULL ELSE aesthetic END DESC NULLS LAST",
    "key",
    "filename",
    "file_row_number",
)


def bands(max_distance: int) -> list[tuple[int, int]]:
    """(shift, width) of the k + 1 bands a 64-bit hash is split into, widths as equal as can be."""
    num = max_distance + 1
    widths = [64 // num + (1 if i < 64 % num else 0) for i in range(num)]
    shifts = np.cumsum([0, *widths[:-1]]).tolist()
    return list(zip(shifts, widths, strict=True))


def phash_losers(hashes: np.ndarray, rank: np.ndarray, max_distance: int) -> np.ndarray:
    """Rows with a better-ranked row within `max_distance` bits; bool [N] in input order.

    `hashes` uint64 [N], `rank` int64 [N] (unique; lower is better).
    """
    if len(hashes) < 2:
        return np.zeros(len(hashes), bool)
    con = duckdb.connect()
    con.register(
        "rows_in",
        pa.table(
            {
                "i": np.arange(len(hashes)),
                "h": pa.array(np.asarray(hashes, np.uint64)),
                "rank": np.asarray(rank, np.int64),
            }
        ),
    )
    band_columns = ", ".join(
        f"(h >> {shift}) & {(1 << width) - 1}::UBIGINT AS b{j}"
        for j, (shift, width) in enumerate(bands(max_distance))
    )
    # One row per distinct hash, with the best rank among the rows that have it.
    con.sql(
        f"CREATE TABLE hashes AS SELECT h, min(rank) AS best, {band_columns} "
        "FROM rows_in GROUP BY h"
    )
    # Pairs of distinct hashes within the distance; a pair agreeing on several bands appears
    # several times, which the min() below absorbs.
    near = " UNION ALL ".join(
        f"SELECT a.h AS a, b.h AS b FROM hashes a JOIN hashes b ON a.b{j} = b.b{j} AND a.h < b.h "
        f"WHERE bit_count(xor(a.h, b.h)) <= {max_distance}"
        for j in range(len(bands(max_distance)))
    )
    con.sql(f"CREATE TABLE near AS {near}")
    con.sql("""
        CREATE TABLE neighbour_best AS
        SELECT h, min(best) AS best FROM (
            SELECT near.a AS h, hb.best FROM near JOIN hashes hb ON hb.h = near.b
            UNION ALL
            SELECT near.b AS h, ha.best FROM near JOIN hashes ha ON ha.h = near.a
        ) GROUP BY h
    """)
    lost = con.sql("""
        SELECT r.rank > least(g.best, coalesce(n.best, g.best)) AS lost
        FROM rows_in r JOIN hashes g USING (h) LEFT JOIN neighbour_best n USING (h)
        ORDER BY r.i
    """).fetchnumpy()["lost"]
    return np.asarray(lost, bool)


def semantic_losers(
    embeddings: np.ndarray,
    rank: np.ndarray,
    threshold: float,
    *,
    block: int = 2048,
    device: str | torch.device | None = None,
) -> np.ndarray:
    """Rows with a better-ranked row at embedding cosine >= `threshold`; bool [N].

    Exact: every pair is compared, block by block (block x block similarities in memory at a
    time), so the cost is N^2 x dim multiply-adds: on a GPU when there is one.
    """
    n = len(embeddings)
    if n < 2:
        return np.zeros(n, bool)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x_ND = F.normalize(torch.from_numpy(np.asarray(embeddings)).to(device, torch.float32), dim=1)
    x_ND = x_ND.to(dtype)
    rank_N = torch.from_numpy(np.asarray(rank, np.int64)).to(device)
    never = torch.iinfo(torch.int64).max
    best_N = torch.full((n,), never, dtype=torch.int64, device=device)
    for i0 in range(0, n, block):
        i1 = min(i0 + block, n)
        for j0 in range(i0, n, block):
            j1 = min(j0 + block, n)
            close_IJ = (x_ND[i0:i1] @ x_ND[j0:j1].T).float() >= threshold
            if i0 == j0:
                close_IJ.fill_diagonal_(False)
            ranks_j = torch.where(close_IJ, rank_N[None, j0:j1], never).amin(dim=1)
            ranks_i = torch.where(close_IJ, rank_N[i0:i1, None], never).amin(dim=0)
            best_N[i0:i1] = torch.minimum(best_N[i0:i1], ranks_j)
            best_N[j0:j1] = torch.minimum(best_N[j0:j1], ranks_i)
    return (rank_N > best_N).cpu().numpy()


def _scalar(con: duckdb.DuckDBPyConnection, sql: str):
    return con.sql(sql).fetchall()[0][0]


def mark(
    con: duckdb.DuckDBPyConnection, profile: FilterProfile, level: str, scores_dir: Path | None
) -> tuple[int, int]:
    """Mark one level's duplicates among the still-kept rows of table `passing` (column `reason`
    NULL = kept); returns (alone: among all of them, removed: among the still-kept ones)."""
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
        rank = f"row_number() OVER (ORDER BY {', '.join(_rank_terms(con))})"
        value = "phash" if level == "phash" else "key"
        rows = con.sql(
            f"SELECT rowid AS id, reason IS NULL AS kept, {value} AS value, {rank} AS rank "
            f"FROM passing WHERE {value} IS NOT NULL ORDER BY rank"
        ).fetchnumpy()
        ids, kept, rank_ = rows["id"], np.asarray(rows["kept"], bool), rows["rank"]
        if len(ids) == 0:
            return 0, 0
        if level == "phash":
            hashes = np.asarray(rows["value"], np.uint64)

            def losers(mask: np.ndarray) -> np.ndarray:
                return phash_losers(hashes[mask], rank_[mask], profile.phash_distance)
        else:
            vectors = load_embeddings(scores_dir, rows["value"])

            def losers(mask: np.ndarray) -> np.ndarray:
                return semantic_losers(vectors[mask], rank_[mask], profile.semantic_threshold)

        alone = int(losers(np.ones(len(ids), bool)).sum())
        lost_ids = ids[kept][losers(kept)]
        con.register("lost", pa.table({"id": pa.array(lost_ids, pa.int64())}))
        con.sql(f"UPDATE passing SET reason = '{reason}' WHERE rowid IN (SELECT id FROM lost)")
        con.unregister("lost")
    removed = _scalar(con, f"SELECT count(*) FROM passing WHERE reason = '{reason}'")
    return alone, removed


def _rank_terms(con: duckdb.DuckDBPyConnection) -> list[str]:
    columns = {r[0] for r in con.sql("DESCRIBE passing").fetchall()}
    needs = (("width", "height"), ("aesthetic",), ("key",), ("filename",), ("file_row_number",))
    return [t for t, cols in zip(RANK_ORDER, needs, strict=True) if set(cols) <= columns]


def load_embeddings(scores_dir: Path | None, keys) -> np.ndarray:
    """The score stage's embeddings of `keys`, float16 [len(keys), dim], in `keys` order."""
    files = sorted(scores_dir.glob("[0-9]*.parquet")) if scores_dir else []
    table = pa.concat_tables([pq.read_table(f, columns=["key", "embedding"]) for f in files])
    position = pc.index_in(pa.array(list(keys), pa.string()), value_set=table["key"])
    chosen = table["embedding"].take(position).combine_chunks()
    dim = chosen.type.list_size
    return np.asarray(chosen.flatten()).reshape(-1, dim)
