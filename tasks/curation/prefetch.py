"""prefetch-dedup: semantic dedup of a URL source's filtered rows on published image embeddings,
before fetch-images, so a duplicate is never fetched, scored or encoded (docs/sources.md).

The embeddings folder has LAION's layout: `img_emb/img_emb_NNNN.npy` (fp16 [n, D]) beside a
`metadata_NNNN.parquet` of the same n rows in order. They are joined to the filtered rows by URL
(and LAION's `hash` where both sides have it) in one DuckDB join that spills; each row's
embedding is then copied per filtered shard from memory-mapped parts. `filtered/` stays as the
metadata filter wrote it: fetch-images skips the keys of `prefetch/dropped/NNNNN.parquet`.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import CatalogError, FilterProfile, Source
from sdtrain.atomic import atomic_path
from tasks.curation import dedup, duck, waterfall
from tasks.curation.filter import ALL, profile_settings
from tasks.runtime.shards import ShardStats, run_shard, stats_path

STAGE = "prefetch"
REASON = "semantic_prefetch"
EMBEDDINGS, DROPPED = "embeddings", "dropped"  # subfolders of <root>/<source>/prefetch/
NPY = re.compile(r"img_emb_(\d+)\.npy")
METADATA = re.compile(r"metadata_(\d+)\.parquet")
URL_SPELLINGS = ("url", "URL")  # LAION's embedding metadata says `url`, its other parts `URL`


class EmbeddingsError(CatalogError):
    """The source's `embeddings` option names no folder of LAION's embeddings layout."""


def wanted(src: Source, profile: FilterProfile) -> bool:
    return profile.semantic_prefetch and bool(src.options.get("embeddings"))


def dropped_path(root: Path, source: str, shard: str) -> Path:
    """The keys fetch-images leaves out of filtered shard `shard` (a `key` column)."""
    return root / source / STAGE / DROPPED / f"{shard}.parquet"


def embedding_parts(src: Source) -> list[tuple[Path, Path]]:
    """(metadata parquet, embeddings npy) of each part under the source's `embeddings` option
    (a local folder or a file:// URL), paired by their part number."""
    location = str(src.options.get("embeddings", ""))
    folder = Path(location.removeprefix("file://"))
    npys = {int(m[1]): p for p in folder.glob("img_emb/*.npy") if (m := NPY.fullmatch(p.name))}
    metas = {
        int(m[1]): p
        for p in folder.rglob("metadata_*.parquet")
        if (m := METADATA.fullmatch(p.name))
    }
    if not npys:
        raise EmbeddingsError(
            f"source {src.name!r}: embeddings {location!r} holds no img_emb/img_emb_NNNN.npy "
            "(LAION's layout: img_emb/img_emb_NNNN.npy beside metadata_NNNN.parquet)"
        )
    lone = sorted(set(npys) ^ set(metas))
    if lone:
        raise EmbeddingsError(
            f"source {src.name!r}: embeddings {location!r}: parts {lone[:5]} have an "
            "img_emb_NNNN.npy or a metadata_NNNN.parquet but not both"
        )
    return [(metas[i], npys[i]) for i in sorted(npys)]


def _filtered(root: Path, source: str) -> list[Path]:
    return sorted((root / source / "filtered").glob("[0-9]*.parquet"))


def _join(con, root: Path, source: str, parts: list[tuple[Path, Path]], out: Path) -> dict:
    """Write (shard, key, part, row) of every filtered row with an embedding to `out`, one
    hive partition per shard: one hash join of the filtered rows with every part's URLs (and
    hashes), which DuckDB spills past its memory cap. A row matched twice takes its first."""
    files = _filtered(root, source)
    meta = [str(m) for m, _ in parts]
    schema = pq.read_schema(parts[0][0]).names
    url = next((s for s in URL_SPELLINGS if s in schema), None)
    if url is None:
        raise EmbeddingsError(f"{parts[0][0]}: no url column; found {schema}")
    with_hash = "hash" in schema and "hash" in pq.read_schema(files[0]).names
    con.register(
        "shard_of",
        pa.table({"filename": [str(f) for f in files], "shard": [f.stem for f in files]}),
    )
    con.register("part_of", pa.table({"filename": meta, "part": np.arange(len(meta))}))
    hashes = "AND (f.hash = e.hash) IS NOT FALSE" if with_hash else ""
    e_hash = ", e.hash::BIGINT AS hash" if with_hash else ""
    con.sql(f"""
        COPY (
            SELECT f.shard, f.key, e.part, e.row FROM (
                SELECT key, url{", hash" if with_hash else ""}, shard
                FROM read_parquet({[str(f) for f in files]!r}, filename=true)
                JOIN shard_of USING (filename)
            ) f JOIN (
                SELECT e.{url}::VARCHAR AS url{e_hash}, p.part, e.file_row_number AS row
                FROM read_parquet({meta!r}, filename=true, file_row_number=true) e
                JOIN part_of p USING (filename)
            ) e ON f.url = e.url {hashes}
            QUALIFY row_number() OVER (PARTITION BY f.key ORDER BY e.part, e.row) = 1
        ) TO '{out}' (FORMAT parquet, PARTITION_BY (shard))
    """)
    return {"joined_on": ["url", "hash"] if with_hash else ["url"]}


def _write_embeddings(
    shard: str, mapping: Path, parts: list[tuple[Path, Path]], dest: Path
) -> None:
    """`dest`: key + embedding (fp16 fixed-size list, score's layout) of the shard's rows that
    have one, read from the memory-mapped parts: memory holds a shard's embeddings."""
    files = sorted((mapping / f"shard={shard}").glob("*.parquet"))
    table = pq.read_table(files, columns=["key", "part", "row"]) if files else None
    keys, blocks = [], []
    if table is not None and table.num_rows:
        table = table.sort_by([("part", "ascending"), ("row", "ascending")])
        part, row = table["part"].to_numpy(), table["row"].to_numpy()
        # Sorted by part then row: each part's rows are one run, in order (one pass over them).
        used, starts = np.unique(part, return_index=True)
        for p, lo, hi in zip(used, starts, [*starts[1:], len(part)], strict=True):
            emb = np.load(parts[p][1], mmap_mode="r")
            blocks.append(np.asarray(emb[row[lo:hi]], np.float16))
        keys = table["key"].to_pylist()
    dim = blocks[0].shape[1] if blocks else np.load(parts[0][1], mmap_mode="r").shape[1]
    flat = np.concatenate(blocks).reshape(-1) if blocks else np.zeros(0, np.float16)
    out = pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float16()), dim),
        }
    )
    with atomic_path(dest) as tmp:
        pq.write_table(out, tmp)


def join_embeddings(root: Path, src: Source) -> dict:
    """`prefetch/embeddings/NNNNN.parquet` for each filtered shard that lacks one (a rerun
    after a kill redoes only those)."""
    parts = embedding_parts(src)
    out_dir = root / src.name / STAGE / EMBEDDINGS
    missing = [f.stem for f in _filtered(root, src.name) if not (out_dir / f.name).exists()]
    if not missing:
        return {}
    out_dir.mkdir(parents=True, exist_ok=True)
    con = duck.connect(root)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".join.tmp-") as tmp:
        notes = _join(con, root, src.name, parts, Path(tmp) / "mapping")
        for shard in missing:
            _write_embeddings(shard, Path(tmp) / "mapping", parts, out_dir / f"{shard}.parquet")
    return notes


def prefetch_dedup(root: Path, src: Source, profile: FilterProfile) -> ShardStats:
    """Semantic dedup (`dedup.mark`, the one-node SemanticIndex) over the filtered rows with a
    published embedding; writes `prefetch/dropped/NNNNN.parquet` per filtered shard, the
    waterfall and gallery, and the record (`semantic_prefetch` drops; `no_embedding`: rows kept
    for want of one). Rows of shards fetched before are kept (their images are there)."""
    source, stage_dir = src.name, root / src.name / STAGE

    def work(stats: ShardStats) -> None:
        files = [str(f) for f in _filtered(root, source)]
        if not files:  # nothing passed the metadata filter: nothing to join or fetch
            stats.extra = {"no_embedding": 0, "num_shards": 0}
            return
        notes = join_embeddings(root, src)
        emb = [str(p) for p in sorted((stage_dir / EMBEDDINGS).glob("[0-9]*.parquet"))]
        con = duck.connect(root)
        con.sql(
            f"CREATE VIEW rows AS SELECT * FROM read_parquet({files!r}, filename=true, "
            "file_row_number=true)"
        )
        have = {r[0] for r in con.sql("DESCRIBE rows").fetchall()}
        extra = ", ".join(c for c in ("width", "height", "aesthetic") if c in have)
        con.sql(
            f"CREATE TEMP TABLE passing AS SELECT key, {extra + ', ' if extra else ''}filename, "
            "file_row_number, NULL::VARCHAR AS reason FROM rows "
            f"WHERE key IN (SELECT key FROM read_parquet({emb!r}))"
        )
        num_in = con.sql("SELECT count(*) FROM rows").fetchall()[0][0]
        with_embedding = con.sql("SELECT count(*) FROM passing").fetchall()[0][0]
        alone, _ = dedup.mark(con, profile, "semantic", stage_dir / EMBEDDINGS, notes=notes)
        fetched = [f for f in files if stats_path(root, source, "shards", Path(f).stem).exists()]
        con.register("fetched", pa.table({"filename": pa.array(fetched, pa.string())}))
        kept_fetched = con.execute(
            "UPDATE passing SET reason = NULL WHERE reason IS NOT NULL "
            "AND filename IN (SELECT filename FROM fetched)"
        ).fetchall()[0][0]
        # Ordered by file then key: each file's losers are one run of the table (one pass).
        lost = duck.to_arrow(
            con.sql(
                "SELECT key, filename FROM passing WHERE reason IS NOT NULL ORDER BY filename, key"
            )
        )
        per_file = dict(
            con.sql(
                "SELECT filename, count(*) FROM passing WHERE reason IS NOT NULL GROUP BY filename"
            ).fetchall()
        )
        offset = 0
        for f in sorted(files):  # every shard gets its list, empty or not: fetch reads it
            n = per_file.get(f, 0)
            with atomic_path(dropped_path(root, source, Path(f).stem)) as tmp:
                pq.write_table(lost.slice(offset, n).select(["key"]), tmp)
            offset += n
        samples = duck.to_arrow(
            con.sql(
                f"SELECT r.key, r.caption, r.url FROM rows r JOIN passing p USING (key) "
                f"WHERE p.reason IS NOT NULL ORDER BY r.key LIMIT {waterfall.MAX_SAMPLES}"
            )
        ).to_pylist()
        wf = waterfall.build(
            stage="prefetch-dedup",
            profile=profile.name,
            num_in=num_in,
            counts=[(REASON, alone, lost.num_rows)],
            samples={REASON: samples},
            notes=notes,
        )
        stats.num_in, stats.num_out = num_in, num_in - lost.num_rows
        if lost.num_rows:
            stats.drop(REASON, lost.num_rows)
        stats.extra = {
            "no_embedding": num_in - with_embedding,
            "kept_already_fetched": kept_fetched,
            "num_shards": len(files),
            "embeddings": str(src.options["embeddings"]),
            "profile": profile.name,
            "profile_settings": profile_settings(profile),
            **notes,
        }
        wf.write(stage_dir / "waterfall.json", stage_dir / "gallery.html")

    stage_dir.mkdir(parents=True, exist_ok=True)
    for stale in stage_dir.glob(".join.tmp-*"):  # a killed run's join
        shutil.rmtree(stale, ignore_errors=True)
    return run_shard(root, source, STAGE, ALL, work)
