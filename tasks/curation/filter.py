"""filter: DuckDB SQL generated from a filter profile, over metadata or fetched shards + scores.

Each row is counted under the first rule it fails, in the order of `rules()`: the waterfall.
Duplicates are judged only among rows that pass every rule (a copy of a dropped row is no
duplicate; `tasks.curation.dedup`). Exact copies keep the smallest key, near ones the best-ranked
row.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import duckdb

from catalog import CatalogError, FilterProfile
from tasks.curation import dedup, duck, waterfall
from tasks.curation.duck import connect, to_arrow
from tasks.curation.waterfall import MAX_SAMPLES, Waterfall
from tasks.runtime.shards import ShardStats, run_shard, stats_path

ALL = "all"  # the shard name of a stage that runs as one unit over the whole source
Stage = Literal["metadata", "pixels"]

# Score column -> (profile field, bound kind, lowest valid, highest valid). A missing, NaN or
# out-of-range score fails its rule: it cannot be shown to pass.
SCORES = {
    "aesthetic": ("min_aesthetic", "min", 0.0, 10.0),
    "similarity": ("min_similarity", "min", -1.0, 1.0),
    "pwatermark": ("max_pwatermark", "max", 0.0, 1.0),
    "punsafe": ("max_punsafe", "max", 0.0, 1.0),
}
# Dedup levels in the order they are judged; `key` always runs first (keys must be unique).
LEVELS = ("key", "url", "sha256", "phash", "semantic")
PIXEL_LEVELS = ("sha256", "phash", "semantic")  # need fetched images
SIDES = ("width", "height")
POSITION = ("filename", "file_row_number")  # where a row was read; not data
MASK = "failed_rules"  # column of the gallery's sample rows: bit i set = fails rule i
SAMPLE_HEAD = 65536  # metadata rows read for the gallery's samples before falling back to scans
SAMPLE_COLUMNS = ("key", "caption", "url", "sha256", "phash", *SCORES, "width", "height")
# Columns of an input with no rows, so an empty source gives a zero-row report, not an error.
EMPTY_COLUMNS = {
    "key": "VARCHAR",
    "source": "VARCHAR",
    "url": "VARCHAR",
    "caption": "VARCHAR",
    "width": "DOUBLE",
    "height": "DOUBLE",
    **{c: "DOUBLE" for c in SCORES},
    "sha256": "VARCHAR",
    "phash": "UBIGINT",
    "filename": "VARCHAR",
    "file_row_number": "BIGINT",
}


class ProfileError(CatalogError):
    """A profile needs a column the rows lack (the message lists the ones they have).

    A catalog error: flows report it in one line, as they report any other catalog mistake.
    """


class ProfileChanged(CatalogError):
    """A source's build profile changed after its rows were selected with it."""


# What was built from a unit's output, in pipeline order (folders under <root>/<source>/).
BUILT_AFTER = {
    "filtered": ("prefetch", "shards", "scores", "selected", "views", "tokens", "hf", "latents"),
    "selected": ("views", "tokens", "hf", "latents"),
}


# Settings that change only which rows are fetched from now on, not a selection made: switched
# on for a built root, the shards fetched before stay and the rest are deduplicated first.
BEFORE_FETCH_ONLY = ("semantic_prefetch",)


@dataclass(frozen=True, slots=True)
class Rule:
    reason: str
    passes: str  # SQL over a row; NULL counts as failing
    columns: tuple[str, ...]


def _ident(column: str) -> str:
    return '"' + column.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _regex(text: str) -> str:
    """`text` as an RE2 pattern matching it literally, any run of spaces matching any other."""
    escaped = re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text.strip())
    return re.sub(r"\s+", r"\\s+", escaped)


def _side(column: str) -> str:
    """A known image side: positive and not NaN, else NULL (unknown)."""
    return f"CASE WHEN {column} > 0 AND NOT isnan({column}::DOUBLE) THEN {column} END"


def rules(
    profile: FilterProfile, *, stage: Stage = "metadata", available: set[str] | None = None
) -> list[Rule]:
    """The profile's rules, in waterfall order.

    A size that is missing, NaN or not positive is unknown: the metadata rule passes it (the
    fetched pixels are measured), the pixel rule fails it. A score the metadata lacks entirely
    is left to the pixel stage when the profile has a scorer. A row without a URL never gets
    here: the metadata stage drops it on ingest (`missing_url`).
    """
    out = []
    if profile.url_blocklist:
        domains = "|".join(_regex(d.lower()) for d in profile.url_blocklist)
        host = rf"^[a-z][a-z0-9+.-]*://([^/?#@]*@)?([^/?#:]*\.)?({domains})(:[0-9]*)?([/?#]|$)"
        out.append(
            Rule(
                "url_blocklist",
                f"NOT coalesce(regexp_matches(url, {_literal(host)}, 'i'), false)",
                ("url",),
            )
        )
    if profile.min_side:
        if stage == "metadata":  # fails only on a known side under the floor (NaN < x is false)
            below = [f"{c} > 0 AND {c} < {profile.min_side}" for c in SIDES]
            passes = " AND ".join(f"NOT coalesce({b}, false)" for b in below)
        else:  # both sides known and at the floor (least() would skip an unknown side)
            sides = " AND ".join(f"{_side(c)} >= {profile.min_side}" for c in SIDES)
            passes = f"coalesce({sides}, false)"
        out.append(Rule("too_small", passes, SIDES))
    if profile.min_caption_words:
        words = (
            "CASE WHEN caption IS NULL OR trim(caption) = '' THEN 0 "
            r"ELSE len(regexp_split_to_array(trim(caption), '\s+')) END"
        )
        out.append(Rule("short_caption", f"{words} >= {profile.min_caption_words}", ("caption",)))
    if profile.caption_blocklist:
        phrases = "|".join(_regex(p) for p in profile.caption_blocklist)
        pattern = _literal(rf"\b({phrases})\b")
        out.append(
            Rule(
                "caption_blocklist",
                f"NOT coalesce(regexp_matches(caption, {pattern}, 'i'), false)",
                ("caption",),
            )
        )
    for column, (fld, bound, low, high) in SCORES.items():
        value = getattr(profile, fld)
        if value is None:
            continue
        deferred = stage == "metadata" and available is not None and column not in available
        if deferred and profile.scorer:
            continue  # the score stage computes it from the pixels; judged there
        low, high = (max(value, low), high) if bound == "min" else (low, min(value, high))
        # Both bounds are finite and NaN compares above every number in DuckDB: `<= high`
        # fails it (an `isnan` here cost ~5% of the stage).
        passes = f"{column} >= {low!r}::DOUBLE AND {column} <= {high!r}::DOUBLE"
        out.append(Rule(column, passes, (column,)))
    for column, value in profile.min_values.items():
        c = _ident(column)
        passes = f"NOT isnan({c}::DOUBLE) AND {c} >= {float(value)!r}::DOUBLE"
        out.append(Rule(f"min_{column}", passes, (column,)))
    for column, value in profile.max_values.items():
        c = _ident(column)
        passes = f"NOT isnan({c}::DOUBLE) AND {c} <= {float(value)!r}::DOUBLE"
        out.append(Rule(f"max_{column}", passes, (column,)))
    return out


def levels(profile: FilterProfile, stage: Stage) -> list[str]:
    """Dedup levels the stage judges, in order: key always; pixel levels only on pixels."""
    wanted = {"key", *profile.dedup}
    if stage == "metadata":
        wanted -= set(PIXEL_LEVELS)
    return [level for level in LEVELS if level in wanted]


def _check_columns(
    profile: FilterProfile,
    stage: Stage,
    rule_list: list[Rule],
    level_list: list[str],
    available: list[str],
    has_embeddings: bool,
) -> None:
    needed = {c: r.reason for r in rule_list for c in r.columns}
    needed.update({level: f"duplicate_{level}" for level in level_list if level != "semantic"})
    missing = sorted(c for c in needed if c not in available)
    if "semantic" in level_list and not has_embeddings:
        missing.append("embedding")
    if missing:
        scores = set(missing) & {*SCORES, "phash", "embedding"}
        hint = (
            "; scores, pHash and embeddings come from the metadata or the score stage "
            "(set `scorer` on the profile)"
            if scores
            else ""
        )
        named = ", ".join(f"{c!r} (rule {needed.get(c, 'duplicate_semantic')})" for c in missing)
        raise ProfileError(
            f"profile {profile.name!r} reads {named}: no such column in the {stage} rows; "
            f"available: {', '.join(available)}{hint}"
        )


def _scalar(con: duckdb.DuckDBPyConnection, sql: str):
    return con.sql(sql).fetchall()[0][0]


def _failed(rule_list: list[Rule]) -> str:
    """SQL: the rules a row fails, as a bit mask (bit i: rule i)."""
    bits = [f"(NOT coalesce({r.passes}, false))::UBIGINT << {i}" for i, r in enumerate(rule_list)]
    return " | ".join(f"({b})" for b in bits) or "0::UBIGINT"


def _rule_counts(
    con: duckdb.DuckDBPyConnection, rule_list: list[Rule]
) -> tuple[int, list[tuple[str, int, int]]]:
    """(rows in, per rule: (reason, rows it fails alone, rows it is the first to fail)).

    One scan reading only the rules' columns. It counts passes, not failures: `count_if`
    counts TRUE only, so a NULL (unknown) pass is a failure with no `coalesce`, and the rows
    first failing rule i are those passing rules 0..i-1 less those passing 0..i. (Measured on
    10M rows: 0.39 CPU-s against 0.65 for `count(*) FILTER (NOT coalesce(...))` per rule.)
    """
    passes = ", ".join(f"({r.passes}) AS p{i}" for i, r in enumerate(rule_list))
    prefixes = [" AND ".join(f"p{j}" for j in range(i + 1)) for i in range(len(rule_list))]
    totals = con.sql(
        f"SELECT count(*){''.join(f', count_if(p{i})' for i in range(len(rule_list)))}"
        f"{''.join(f', count_if({p})' for p in prefixes)} FROM (SELECT {passes or 'true'} "
        "FROM rows)"
    ).fetchall()[0]
    totals = [t or 0 for t in totals]  # count_if over no rows is NULL
    num_in, n = totals[0], len(rule_list)
    passing_prefix = [num_in, *totals[1 + n :]]  # rows passing rules 0..i-1, for i = 0..n
    return num_in, [
        (r.reason, num_in - totals[1 + i], passing_prefix[i] - passing_prefix[i + 1])
        for i, r in enumerate(rule_list)
    ]


def judge(
    con: duckdb.DuckDBPyConnection,
    profile: FilterProfile,
    stage: Stage,
    *,
    label: str,
    scores_dir: Path | None = None,
    device: str | None = None,
    phash: dedup.PhashLosers | None = None,
    semantic: dedup.SemanticLosers | None = None,
) -> Waterfall:
    """Judge the relation `rows`: leaves table `passing` (rows passing every rule, with `reason`
    NULL for the kept ones and `duplicate_<level>` for the rest) and returns the waterfall.
    `device`: where semantic dedup computes (a GPU the caller holds a slot of; default CPU);
    `phash`, `semantic`: how those levels find their losers (`dedup.mark`)."""
    available = [r[0] for r in con.sql("DESCRIBE rows").fetchall() if r[0] not in POSITION]
    rule_list = rules(profile, stage=stage, available=set(available))
    level_list = levels(profile, stage)
    _check_columns(profile, stage, rule_list, level_list, available, scores_dir is not None)
    if len(rule_list) > 64:
        raise ProfileError(f"profile {profile.name!r} has {len(rule_list)} rules; at most 64")

    num_in, counts = _rule_counts(con, rule_list)
    pixels = stage == "pixels"
    # The rejected samples come from their own scans of `rows`, on a second connection to the
    # same database, beside the passing scan (the head scan is single-threaded: ~0.1 s of one
    # core on 10M rows, overlapped here).
    with con.cursor() as side, ThreadPoolExecutor(1) as pool:  # the thread ends first
        sampling = pool.submit(_samples, side, rule_list, list(counts), pixels=pixels)
        _passing(con, rule_list)
        # The stage's promise (every row kept or counted under one reason) rests on two
        # evaluations of the same SQL agreeing: a projection above, a pushed-down filter here.
        num_passing = _scalar(con, "SELECT count(*) FROM passing")
        if num_passing != num_in - sum(c[2] for c in counts):
            raise AssertionError(f"rules counted {num_in} - {counts} but {num_passing} rows pass")
        notes: dict = {}  # what semantic dedup measured besides its counts
        for level in level_list:
            marked = dedup.mark(
                con,
                profile,
                level,
                scores_dir,
                device=device,
                notes=notes,
                phash=phash,
                semantic=semantic,
            )
            counts.append((f"duplicate_{level}", *marked))
        samples = sampling.result()
    samples |= _duplicate_samples(con, level_list, pixels=pixels)
    wf = waterfall.build(
        stage=label, profile=profile.name, num_in=num_in, counts=counts, samples=samples
    )
    wf.notes = notes
    return wf


def _passing(con: duckdb.DuckDBPyConnection, rule_list: list[Rule]) -> None:
    """Table `passing`: the rows passing every rule, `reason` NULL.

    The rules are plain conjunctions, which DuckDB pushes into the parquet scan (which then
    decodes the other columns of the passing rows only). Its row order is never read (every
    ordered use says ORDER BY), so this session's scan threads need not keep file order; other
    sessions (the samples' head scan) keep it.
    """
    where = " AND ".join(f"({r.passes})" for r in rule_list) or "true"
    con.sql("SET SESSION preserve_insertion_order = false")
    con.sql(
        f"CREATE TEMP TABLE passing AS SELECT *, NULL::VARCHAR AS reason FROM rows WHERE {where}"
    )
    con.sql("RESET SESSION preserve_insertion_order")


def _sample_columns(con: duckdb.DuckDBPyConnection) -> str:
    have = {r[0] for r in con.sql("DESCRIBE rows").fetchall()}
    return ", ".join(_ident(c) for c in (*SAMPLE_COLUMNS, "filename") if c in have)


def _fetch_samples(con: duckdb.DuckDBPyConnection, sql: str, pixels: bool) -> list[dict]:
    return [_sample(row, pixels) for row in to_arrow(con.sql(sql)).to_pylist()]


def _samples(
    con: duckdb.DuckDBPyConnection,
    rule_list: list[Rule],
    counts: list[tuple[str, int, int]],
    *,
    pixels: bool,
) -> dict[str, list[dict]]:
    """Up to MAX_SAMPLES rejected rows per rule: the first in file order (metadata) or by key
    (pixels). Metadata samples come from the first SAMPLE_HEAD rows where those hold enough
    (one short scan for every rule), else from a scan of `rows` that stops early."""
    columns = _sample_columns(con)
    out: dict[str, list[dict]] = {}
    if not pixels and any(removed for _, _, removed in counts):
        con.sql(
            f"CREATE TEMP TABLE sample_head AS SELECT {columns}, {_failed(rule_list)} AS {MASK} "
            f"FROM rows LIMIT {SAMPLE_HEAD}"
        )  # insertion order is scan order: rowid orders it
    for i, (r, (_, _, removed)) in enumerate(zip(rule_list, counts, strict=True)):
        if not removed:
            continue
        if not pixels:  # the rows whose lowest bit set is bit i
            out[r.reason] = _fetch_samples(
                con,
                f"SELECT {columns} FROM sample_head WHERE {MASK} & {(2 << i) - 1}::UBIGINT = "
                f"{1 << i}::UBIGINT ORDER BY rowid LIMIT {MAX_SAMPLES}",
                pixels,
            )
            if len(out[r.reason]) == min(removed, MAX_SAMPLES):
                continue
        before = "".join(f" AND coalesce({p.passes}, false)" for p in rule_list[:i])
        out[r.reason] = _fetch_samples(
            con,
            f"SELECT {columns} FROM rows WHERE NOT coalesce({r.passes}, false){before}"
            f"{' ORDER BY key' if pixels else ''} LIMIT {MAX_SAMPLES}",
            pixels,
        )
    return out


def _duplicate_samples(
    con: duckdb.DuckDBPyConnection, level_list: list[str], *, pixels: bool
) -> dict[str, list[dict]]:
    columns = _sample_columns(con)
    return {
        f"duplicate_{level}": _fetch_samples(
            con,
            # Copies of one key tie on it: where they were read settles them (a gallery that
            # does not change between runs, and the partitioned filter's).
            f"SELECT {columns} FROM passing WHERE reason = 'duplicate_{level}' "
            f"ORDER BY key, filename, file_row_number LIMIT {MAX_SAMPLES}",
            pixels,
        )
        for level in level_list
    }


def _sample(row: dict, with_tar: bool) -> dict:
    out = {}
    for k in SAMPLE_COLUMNS:
        v = row.get(k)
        out[k] = None if isinstance(v, float) and math.isnan(v) else v
    if with_tar and row.get("filename"):
        out["tar"] = str(Path(row["filename"]).with_suffix(".tar"))
    return out


def empty_rows(con: duckdb.DuckDBPyConnection, profile: FilterProfile) -> None:
    """`rows` with no rows and every column the profile may read, for an empty input."""
    columns = dict(EMPTY_COLUMNS)
    columns.update({c: "DOUBLE" for c in (*profile.min_values, *profile.max_values)})
    select = ", ".join(f"NULL::{t} AS {_ident(c)}" for c, t in columns.items())
    con.sql(f"CREATE VIEW rows AS SELECT {select} WHERE false")


def profile_settings(profile: FilterProfile) -> dict:
    """The profile as its stats record keeps it (JSON types)."""
    return json.loads(json.dumps(asdict(profile), sort_keys=True))


def profile_fingerprint(profile: FilterProfile) -> str:
    """Short hash of the profile's settings: part of the filter tasks' cache keys."""
    text = json.dumps(profile_settings(profile), sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def check_profile(root: Path, source: str, stage: str, profile: FilterProfile) -> None:
    """Refuse a finished unit built under other settings of its profile.

    Its output was fetched, scored, tokenized and encoded further on, so rebuilding it alone
    would leave those stages on the old selection, and reusing it would silently ignore the
    edit. Records from before sdpipe kept the settings are accepted as they are.
    """
    record = stats_path(root, source, stage, ALL)
    if not record.exists():
        return
    built = ShardStats.read(record).extra.get("profile_settings")
    now = profile_settings(profile)
    if built is None or built == now:
        return
    # A setting added to profiles since the unit was built reads as its default there (a new
    # field must not refuse every data root built before it).
    defaults = profile_settings(FilterProfile(name=profile.name))
    built = defaults | built
    changed = sorted(
        k
        for k in built.keys() | now.keys()
        if built.get(k) != now.get(k) and k not in BEFORE_FETCH_ONLY
    )
    if not changed:
        return
    diff = "; ".join(f"{k}: {built.get(k)!r} -> {now.get(k)!r}" for k in changed)
    after = ", ".join(BUILT_AFTER[stage])
    raise ProfileChanged(
        f"profile {profile.name!r} changed since {record.parent} was built ({diff}). "
        f"To rebuild with the new settings, delete {record.parent} and the stages built from "
        f"it ({after} under {record.parent.parent}); to keep fewer samples without "
        "fetching again, add a dataset (a view) with a stricter profile instead."
    )


def record(stats: ShardStats, wf: Waterfall) -> None:
    stats.num_in, stats.num_out = wf.num_in, wf.num_out
    for reason, n in wf.dropped.items():
        stats.drop(reason, n)


def filter_metadata(
    root: Path, source: str, profile: FilterProfile, samples_per_shard: int
) -> ShardStats:
    """Metadata rules + URL dedup over `metadata/*.parquet`; writes `filtered/NNNNN.parquet`,
    `filtered/waterfall.json` and `filtered/gallery.html`."""
    out_dir = root / source / "filtered"

    def work(stats: ShardStats) -> None:
        con = connect(root)
        files = sorted((root / source / "metadata").glob("*.parquet"))
        spill = duck.spill_plan(root, files)
        if files:
            con.sql(f"CREATE VIEW rows AS SELECT * FROM {duck.read_files(files)}")
        else:
            empty_rows(con, profile)
        try:
            wf = judge(con, profile, "metadata", label="filter")
            kept = con.sql(
                "SELECT * EXCLUDE (filename, file_row_number, reason) FROM passing "
                "WHERE reason IS NULL ORDER BY key"
            )
            num_shards = duck.write_shards(kept, out_dir, samples_per_shard)
        except (duckdb.OutOfMemoryException, duckdb.IOException) as exc:
            raise spill.error(exc) from exc
        record(stats, wf)
        stats.extra = {
            "num_shards": num_shards,
            "profile": profile.name,
            "profile_settings": profile_settings(profile),
            "duckdb": spill.record(),
        }
        wf.write(out_dir / "waterfall.json", out_dir / "gallery.html")

    check_profile(root, source, "filtered", profile)
    return run_shard(root, source, "filtered", ALL, work)
