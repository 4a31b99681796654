"""filter-pixels: the profile over the fetched pixels (actual sizes, the score stage's scores,
pHash and embeddings) and dedup across the whole source, one unit over every fetched shard;
its rules and waterfall are the metadata filter's (`tasks.curation.filter`)."""

from __future__ import annotations

from pathlib import Path

import duckdb

from catalog import FilterProfile
from sdtrain.atomic import clean_temporaries
from tasks.curation import duck, selection
from tasks.curation.dedup import PhashLosers, SemanticLosers
from tasks.curation.duck import connect
from tasks.curation.filter import (
    ALL,
    EMPTY_COLUMNS,
    SCORES,
    check_profile,
    empty_rows,
    judge,
    profile_settings,
    record,
)
from tasks.runtime.shards import ShardStats, run_shard

KEPT_BATCH_ROWS = 65_536  # kept rows read from DuckDB at once while writing the selection


def pixel_rows(
    con: duckdb.DuckDBPyConnection,
    root: Path,
    source: str,
    profile: FilterProfile,
    *,
    scored: bool,
    selected_only: bool = False,
) -> None:
    """The view `rows`: fetched samples (status success) + their scores, as one table.

    A metadata score that is missing or NaN is replaced by the computed one; rows the score
    stage could not score are not in it. `selected_only`: only the keys filter-pixels kept.
    """
    tables = sorted((root / source / "shards").glob("[0-9]*.parquet"))
    selected = sorted((root / source / "selected").glob("[0-9]*.parquet"))
    if not tables or (selected_only and not selected):
        empty_rows(con, profile)
        return
    samples = duck.read_files(tables)
    con.sql(f"CREATE VIEW samples AS SELECT * FROM {samples} WHERE status = 'success'")
    query = "SELECT * FROM samples"
    if scored:
        score_files = sorted((root / source / "scores").glob("[0-9]*.parquet"))
        computed = [*SCORES, "phash"]
        if score_files:
            con.sql(
                f"CREATE VIEW scores AS SELECT key, {', '.join(computed)} "
                f"FROM read_parquet({[str(p) for p in score_files]!r})"
            )
        else:
            types = ", ".join(f"NULL::{EMPTY_COLUMNS[c]} AS {c}" for c in computed)
            con.sql(f"CREATE VIEW scores AS SELECT NULL::VARCHAR AS key, {types} WHERE false")
        have = {r[0] for r in con.sql("DESCRIBE samples").fetchall()}
        replaced = [
            f"CASE WHEN s.{c} IS NULL OR isnan(s.{c}) THEN c.{c} ELSE s.{c} END AS {c}"
            for c in computed
            if c in have
        ]
        added = [f"c.{c}" for c in computed if c not in have]
        star = f"s.* REPLACE ({', '.join(replaced)})" if replaced else "s.*"
        query = f"SELECT {', '.join([star, *added])} FROM samples s JOIN scores c USING (key)"
    if selected_only:
        keys = [str(p) for p in selected]
        query += f" WHERE key IN (SELECT key FROM read_parquet({keys!r}))"
    con.sql(f"CREATE VIEW rows AS {query}")


def select_pixels(
    root: Path,
    source: str,
    profile: FilterProfile,
    *,
    scored: bool = False,
    device=None,
    scorer_identity: dict | None = None,
    phash: PhashLosers | None = None,
    semantic: SemanticLosers | None = None,
) -> ShardStats:
    """The profile over the fetched pixels (actual sizes; with `scored`, the score stage's
    scores, pHash and embeddings) and dedup across the whole source; semantic dedup runs on
    `device` (a GPU whose pool slot the caller holds; default CPU).

    Reads every `shards/NNNNN.parquet` (status `success` rows) and writes, per shard, the
    kept keys and captions to `selected/NNNNN.parquet`, plus the waterfall and gallery.
    `scorer_identity` (`score.scorer_identity`): the scorer whose scores are read; a selection
    chosen from another's is made again, and what was built from a shard whose rows changed
    runs again (tasks/curation/selection.py). `phash`: how the pHash level finds its losers
    (default: in this process; `phash_partitioned.PartitionedLosers`: as partition tasks);
    `semantic` the same for the semantic level (`semantic_partitioned.PartitionedSemantic`).
    """
    out_dir = root / source / selection.STAGE

    def work(stats: ShardStats) -> None:
        tables = sorted((root / source / "shards").glob("[0-9]*.parquet"))
        con = connect(root)
        pixel_rows(con, root, source, profile, scored=scored)
        wf = judge(
            con,
            profile,
            "pixels",
            label="filter-pixels",
            scores_dir=root / source / "scores" if scored else None,
            device=device,
            phash=phash,
            semantic=semantic,
        )
        kept = con.sql(
            "SELECT key, caption, filename FROM passing WHERE reason IS NULL ORDER BY filename, key"
        )
        # Read in batches (DuckDB keeps the sorted rows, spilling): a shard's rows at most here.
        selection.write_shards(root, source, duck.batches(kept, KEPT_BATCH_ROWS), tables)
        record(stats, wf)
        stats.extra = {
            "num_shards": len(tables),
            "profile": profile.name,
            "profile_settings": profile_settings(profile),
            "scored": scored,
            **wf.notes,
        }
        if scorer_identity is not None:
            stats.extra["scorer_identity"] = scorer_identity
        wf.write(out_dir / "waterfall.json", out_dir / "gallery.html")

    check_profile(root, source, selection.STAGE, profile)
    selection.forget_other_scorer(root, source, scorer_identity)
    if not (out_dir / f"{ALL}.stats.json").exists():
        # Not done (a killed run, or made again): its selection files stay, what each shard's
        # tokens were built from (`selection.write_shards` compares them with the new rows).
        clean_temporaries(out_dir)
    return run_shard(root, source, selection.STAGE, ALL, work)
