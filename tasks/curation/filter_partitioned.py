"""The metadata filter with URL dedup as many bounded tasks over partition files, writing the
filtered shards exactly as `filter.filter_metadata` does (the same rows per shard, same order).

scatter (per input file: the rules, their counts and samples; passing rows by URL hash, a URL
hot in the file spread by row; keys by key hash) -> keys (per key hash: copies of a key after the
first by file position) -> urls (per URL hash: the URL keep-rule on the rows left, kept rows by
key range; a hot URL's local best as a candidate) -> hot (per hot URL's hash: the best candidate)
-> ranges (per key range, its global offset known from the counts: key-sorted, cut at shard
boundaries) -> commit (whole shards linked, a shard spanning ranges joined from its pieces).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import FilterProfile
from sdtrain.atomic import atomic_path
from tasks.curation import duck, waterfall
from tasks.curation import filter as flt
from tasks.curation.partition_files import (
    LocalProcesses,
    digest,
    file_identity,
    folder_bytes,
    run_task,
)
from tasks.runtime.shards import ShardStats, run_shard, shard_name

# A task's DuckDB memory (bytes; `SDPIPE_FILTER_TASK_MEMORY` overrides). Partitions follow from
# it: a key range is sorted whole, at about MEMORY_PER_INPUT_BYTE times its uncompressed size.
TASK_MEMORY_ENV = "SDPIPE_FILTER_TASK_MEMORY"
TASK_MEMORY = 2 * 2**30
MEMORY_PER_INPUT_BYTE = 4.0
# A session's own needs, never less: buffers per thread and writer, and a scatter task reads an
# input file one row group at a time (the metadata stage writes ~1M rows, ~240 MB, a group).
DUCKDB_FLOOR = 2**30
SAMPLES_PER_RANGE = 200  # keys sampled per key range to place the splitters
SAMPLE_DENOMINATOR = 1_000_000
FLUSH_ROWS, MAX_OPEN_FILES = 32_768, 16  # a partitioned write's buffers (`_connect`)
POS_BITS = 40  # pos = input file index << 40 | row in file: the one-node tie order
# A URL on more than `hot_rows` passing rows of one file is spread over every urls task (then
# judged in two steps); hot_rows is such that a URL under it in every file adds at most
# 1/HOT_SHARE of an average urls task to its own. Found in a stride sample of at most
# HOT_SAMPLE_ROWS rows a file (memory bounded; which URLs are spread never changes the output).
HOT_SHARE, HOT_FLOOR, HOT_SAMPLE_ROWS = 8, 64, 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class FilterPlan:
    root: Path  # named by the inputs and settings: a rerun finds finished partitions
    inputs: tuple[str, ...]
    union: bool  # the inputs' schemas differ: read as the one-node path reads them
    profile: FilterProfile
    num_rows: int
    input_bytes: int
    num_parts: int  # URL hashes, key hashes and key ranges alike
    task_memory: int
    threads: int
    hot_rows: int

    def folder(self, stage: str, *index: int) -> Path:
        return self.root.joinpath(stage, *(f"{i:05d}" for i in index))

    def parts(self, stage: str, table: str, column: str, part: int) -> list[str]:
        """The parquet files of partition `part` of `table` in every folder of `stage`."""
        return sorted(str(p) for p in self.root.glob(f"{stage}/*/{table}/{column}={part}/*"))

    @property
    def sample_rate(self) -> int:
        """Keys sampled per SAMPLE_DENOMINATOR (by a hash of the key: deterministic)."""
        want = SAMPLES_PER_RANGE * self.num_parts / max(1, self.num_rows)
        return max(1, min(SAMPLE_DENOMINATOR, math.ceil(want * SAMPLE_DENOMINATOR)))


def task_memory() -> int:
    return int(os.environ.get(TASK_MEMORY_ENV) or TASK_MEMORY)


def make_plan(
    files: list[Path],
    profile: FilterProfile,
    workdir: Path,
    *,
    memory: int | None = None,
    workers: int = 1,
    hot_rows: int | None = None,
) -> FilterPlan:
    """The partitions for metadata `files` from their uncompressed size and `memory` per task;
    a profile that reads a column the rows lack fails here, as the one-node stage fails.
    `hot_rows`: a URL's rows in one file above which they are spread (default from HOT_SHARE)."""
    files = sorted(Path(f) for f in files)
    memory = memory or task_memory()
    size = duck.input_bytes(files)
    con = duckdb.connect()
    if files:
        con.sql(f"CREATE VIEW rows AS SELECT * FROM {duck.read_files(files)}")
    else:
        flt.empty_rows(con, profile)
    available = [r[0] for r in con.sql("DESCRIBE rows").fetchall() if r[0] not in flt.POSITION]
    rule_list = flt.rules(profile, available=set(available))
    flt._check_columns(
        profile, "metadata", rule_list, flt.levels(profile, "metadata"), available, False
    )
    if len(rule_list) > 64:
        raise flt.ProfileError(f"profile {profile.name!r} has {len(rule_list)} rules; at most 64")
    num_rows = sum(pq.read_metadata(f).num_rows for f in files)
    num_parts = max(1, math.ceil(size * MEMORY_PER_INPUT_BYTE / memory))
    settings = flt.profile_settings(profile)
    if hot_rows is None:
        per_task = num_rows / (num_parts * max(1, len(files)) * HOT_SHARE)
        hot_rows = max(HOT_FLOOR, math.ceil(per_task))
    ids = [file_identity(f) for f in files]
    name = digest(ids, settings, num_parts, memory, hot_rows, duckdb.__version__)
    return FilterPlan(
        root=Path(workdir) / f"filter-{name}",
        inputs=tuple(str(f) for f in files),
        union=len({pq.read_schema(f).remove_metadata() for f in files}) > 1,
        profile=profile,
        num_rows=num_rows,
        input_bytes=size,
        num_parts=num_parts,
        task_memory=memory,
        threads=max(1, (os.cpu_count() or 1) // max(1, workers)),
        hot_rows=hot_rows,
    )


def _connect(p: FilterPlan) -> duckdb.DuckDBPyConnection:
    """The filter's session (`duck.connect`), capped at the task's memory and never spilling:
    a task over its memory fails, naming it, rather than filling a disk."""
    con = duck.connect()
    con.sql(f"SET memory_limit = '{max(p.task_memory, DUCKDB_FLOOR) // 2**20}MiB'")
    con.sql("SET temp_directory = ''")
    con.sql(f"SET threads = {p.threads}")
    con.sql("SET enable_progress_bar = false")  # many tasks at once: their bars would interleave
    # A partitioned write buffers rows per thread and a row group per open file: both bounded
    # here, so a scatter task's memory does not follow its input file's size.
    con.sql(f"SET partitioned_write_flush_threshold = {FLUSH_ROWS}")
    con.sql(f"SET partitioned_write_max_open_files = {MAX_OPEN_FILES}")
    return con


def _copy(con, query: str, out: Path, column: str) -> None:
    con.sql(
        f"COPY ({query}) TO '{out}' (FORMAT parquet, PARTITION_BY ({column}), "
        f"FILENAME_PATTERN 'data{{i}}', ROW_GROUP_SIZE {FLUSH_ROWS})"
    )


def _read(files: list[str]) -> str:
    return f"read_parquet({files!r}, hive_partitioning=false)"


def _scatter(tmp: Path, p: FilterPlan, i: int) -> dict:
    con = _connect(p)
    path = p.inputs[i]
    if p.union:  # the one-node relation's columns and types, this file's rows
        source = f"(SELECT * FROM {duck.read_files(list(map(Path, p.inputs)))} "
        source += f"WHERE filename = {flt._literal(path)})"
    else:
        source = duck.read_files([Path(path)])
    con.sql(f"CREATE VIEW rows AS SELECT * FROM {source}")
    available = {r[0] for r in con.sql("DESCRIBE rows").fetchall()}
    rule_list = flt.rules(p.profile, available=available)
    num_in, counts = flt._rule_counts(con, rule_list)
    samples = flt._samples(con, rule_list, counts, pixels=False)  # the first, in file order
    con.sql("SET preserve_insertion_order = false")
    where = " AND ".join(f"({r.passes})" for r in rule_list) or "true"
    pos = f"({i}::BIGINT << {POS_BITS}) | file_row_number"
    # A row with no URL is no URL's copy: any partition does; its key spreads them.
    upart = f"hash(coalesce(url, key)) % {p.num_parts}"
    if "url" not in flt.levels(p.profile, "metadata"):
        upart = f"hash({pos}) % {p.num_parts}"  # no URL decision: every row goes anywhere
    elif p.num_parts > 1:
        # This file's hot URLs, from a stride sample; their rows go anywhere, and the list goes
        # to their URL hash's urls task (`_urls`: a row away from home is a spread one).
        stride = max(1, math.ceil(pq.read_metadata(path).num_rows / HOT_SAMPLE_ROWS))
        con.sql(
            f"CREATE TEMP TABLE hot AS SELECT url, hash(url) % {p.num_parts} AS upart FROM rows "
            f"WHERE file_row_number % {stride} = 0 AND url IS NOT NULL AND {where} GROUP BY url "
            f"HAVING count(*) > {max(1, p.hot_rows // stride)}"
        )
        if flt._scalar(con, "SELECT count(*) FROM hot"):
            _copy(con, "SELECT * FROM hot", tmp / "hot", "upart")
            upart = (
                f"CASE WHEN url IN (SELECT url FROM hot) THEN hash(url, {pos}) % {p.num_parts} "
                f"ELSE {upart} END"
            )
    _copy(
        con,
        f"SELECT * EXCLUDE (filename, file_row_number), {pos} AS pos, {upart} AS upart "
        f"FROM rows WHERE {where}",
        tmp / "rows",
        "upart",
    )
    written = sorted(str(f) for f in (tmp / "rows").glob("*/*.parquet"))
    num_passing = 0
    if written:
        passing = f"read_parquet({written!r}, hive_partitioning=true)"
        num_passing = flt._scalar(con, f"SELECT count(*) FROM {passing}")
        _copy(
            con,
            f"SELECT key, pos, upart, hash(key) % {p.num_parts} AS kpart FROM {passing} "
            "WHERE key IS NOT NULL",
            tmp / "keys",
            "kpart",
        )
        con.sql(
            f"COPY (SELECT key FROM {passing} WHERE key IS NOT NULL AND "
            f"hash(key) % {SAMPLE_DENOMINATOR} < {p.sample_rate}) TO '{tmp / 'splits.parquet'}'"
        )
    (tmp / "samples.json").write_text(json.dumps(samples))
    return {"rows": num_in, "passing": num_passing, "rules": counts}


def _keys(tmp: Path, p: FilterPlan, k: int) -> dict:
    files = p.parts("scatter", "keys", "kpart", k)
    if not files:
        return {"rows": 0, "duplicate_key": 0}
    con = _connect(p)
    con.sql(f"CREATE VIEW keys AS SELECT * FROM {_read(files)}")
    # A key held by a million rows is one group here: its copies stream past, never sorted.
    con.sql(
        "CREATE TEMP TABLE repeated AS SELECT key, min(pos) AS first, count(*) - 1 AS extra "
        "FROM keys GROUP BY key HAVING count(*) > 1"
    )
    lost = int(flt._scalar(con, "SELECT coalesce(sum(extra), 0) FROM repeated"))
    if lost:
        _copy(
            con,
            "SELECT pos, upart FROM keys JOIN repeated USING (key) WHERE pos <> first",
            tmp / "losers",
            "upart",
        )
    rows = flt._scalar(con, "SELECT count(*) FROM keys")
    return {"rows": rows, "duplicate_key": lost}


def _urls(tmp: Path, p: FilterPlan, u: int, splitters: list[str]) -> dict:
    files = p.parts("scatter", "rows", "upart", u)
    if not files:
        return {"rows": 0, "kept": 0, "duplicate_url": [0, 0], "samples": {}}
    con = _connect(p)
    con.sql("SET preserve_insertion_order = false")
    losers = p.parts("keys", "losers", "upart", u)
    lost = f"pos IN (SELECT pos FROM {_read(losers)})" if losers else "false"
    con.sql(f"CREATE VIEW rows AS SELECT * FROM {_read(files)}")
    if "url" in flt.levels(p.profile, "metadata"):
        hot_list = p.parts("scatter", "hot", "upart", u)  # the hot URLs whose hash is u
        listed = f"url IN (SELECT url FROM {_read(hot_list)})" if hot_list else "false"
        # A hot URL's rows are here by their hash (and listed) or spread here from elsewhere:
        # hot in every task that holds some.
        hot = f"url IS NOT NULL AND (hash(url) % {p.num_parts} <> {u} OR {listed})"
        con.sql(f"CREATE VIEW marked AS SELECT *, {lost} AS loser, {hot} AS hot FROM rows")
        # The one-node keep-rule (`dedup.mark`): among the rows left after key dedup, the
        # smallest key (keys are unique there), NULL keys last by file position. Only URLs held
        # by more than one row are kept in the table. A hot URL's best row here is a candidate
        # (`_hot` picks among them), its other rows copies; its count is all its rows here,
        # `_hot` takes one off per URL.
        con.sql(
            "CREATE TEMP TABLE repeated AS SELECT url, any_value(hot) AS hot, "
            "count(*) - 1 + any_value(hot)::INT AS extra, "
            "coalesce(arg_min(pos, key) FILTER (NOT loser), min(pos) FILTER (NOT loser)) AS keep "
            "FROM marked WHERE url IS NOT NULL GROUP BY url HAVING count(*) > 1 OR any_value(hot)"
        )
        con.sql(
            "CREATE VIEW judged AS SELECT m.* EXCLUDE (hot), r.keep IS NOT NULL AND NOT m.loser "
            "AND m.pos <> r.keep AS copy, coalesce(r.hot AND m.pos = r.keep, false) AS candidate "
            "FROM marked m LEFT JOIN repeated r USING (url)"
        )
        alone = int(flt._scalar(con, "SELECT coalesce(sum(extra), 0) FROM repeated"))
    else:
        con.sql(
            f"CREATE VIEW judged AS SELECT *, {lost} AS loser, false AS copy, false AS candidate "
            "FROM rows"
        )
        alone = 0
    columns = flt._sample_columns(con)
    samples = {}
    for reason, where in (("duplicate_key", "loser"), ("duplicate_url", "copy")):
        found = duck.to_arrow(
            con.sql(
                f"SELECT {columns}, pos FROM judged WHERE {where} ORDER BY key, pos "
                f"LIMIT {waterfall.MAX_SAMPLES}"
            )
        ).to_pylist()
        samples[reason] = [[row["pos"], flt._sample(row, False)] for row in found]
    if flt._scalar(con, "SELECT count(*) FROM judged WHERE candidate"):
        _copy(
            con,
            f"SELECT * EXCLUDE (loser, copy, candidate), hash(url) % {p.num_parts} AS home "
            "FROM judged WHERE candidate",
            tmp / "hot",
            "home",
        )
    counts = _keep(
        con,
        p,
        "SELECT * EXCLUDE (loser, copy, candidate) FROM judged "
        "WHERE NOT loser AND NOT copy AND NOT candidate",
        splitters,
        tmp,
    )
    removed = int(flt._scalar(con, "SELECT count(*) FROM judged WHERE copy"))
    num_rows = int(flt._scalar(con, "SELECT count(*) FROM rows"))
    return {"rows": num_rows, "kept": int(counts.sum()), "duplicate_url": [alone, removed]} | {
        "samples": samples
    }


def _keep(con, p: FilterPlan, query: str, splitters: list[str], tmp: Path) -> np.ndarray:
    """The rows of `query` into `kept/` by key range, and their count per range (`counts.npy`)."""
    con.register("splitters", pa.table({"r": range(len(splitters) + 1), "lo": ["", *splitters]}))
    # A NULL key sorts last (ORDER BY key): the last range.
    _copy(
        con,
        f"SELECT j.*, coalesce(s.r, {p.num_parts - 1}) AS r FROM ({query}) j "
        "ASOF LEFT JOIN splitters s ON j.key >= s.lo",
        tmp / "kept",
        "r",
    )
    counts = np.zeros(p.num_parts, np.int64)
    written = sorted(str(f) for f in (tmp / "kept").glob("*/*.parquet"))
    if written:
        for r, n in con.sql(
            f"SELECT r, count(*) FROM read_parquet({written!r}, hive_partitioning=true) GROUP BY r"
        ).fetchall():
            counts[r] = n
    np.save(tmp / "counts.npy", counts)
    return counts


def _hot(tmp: Path, p: FilterPlan, h: int, splitters: list[str]) -> dict:
    """The hot URLs whose hash is h: the best of each one's candidates (the one-node rule among
    them: each is the best of its task's rows) kept, the others copies."""
    con = _connect(p)
    listed = _read(p.parts("scatter", "hot", "upart", h))
    num_hot = flt._scalar(con, f"SELECT count(DISTINCT url) FROM {listed}")
    files = p.parts("urls", "hot", "home", h)
    out = {"rows": 0, "kept": 0, "duplicate_url": [-num_hot, 0], "samples": {}}
    if not files:  # every row of these URLs lost to a copy of its key
        return out
    con.sql("SET preserve_insertion_order = false")
    con.sql(f"CREATE VIEW rows AS SELECT * FROM {_read(files)}")
    con.sql(
        "CREATE TEMP TABLE best AS SELECT url, coalesce(arg_min(pos, key), min(pos)) AS keep "
        "FROM rows GROUP BY url"
    )
    con.sql(
        "CREATE VIEW judged AS SELECT r.*, r.pos <> b.keep AS copy FROM rows r JOIN best b "
        "USING (url)"
    )
    found = duck.to_arrow(
        con.sql(
            f"SELECT {flt._sample_columns(con)}, pos FROM judged WHERE copy ORDER BY key, pos "
            f"LIMIT {waterfall.MAX_SAMPLES}"
        )
    ).to_pylist()
    out["samples"] = {"duplicate_url": [[row["pos"], flt._sample(row, False)] for row in found]}
    counts = _keep(con, p, "SELECT * EXCLUDE (copy) FROM judged WHERE NOT copy", splitters, tmp)
    removed, rows = con.sql("SELECT count_if(copy), count(*) FROM judged").fetchall()[0]
    return out | {"rows": rows, "kept": int(counts.sum()), "duplicate_url": [-num_hot, removed]}


def _range(tmp: Path, p: FilterPlan, r: int, offset: int, samples_per_shard: int) -> dict:
    """Range `r`'s kept rows by key, rows [offset, offset + n) of the output: the shards wholly
    inside it as the stage writes them, the parts of shards it shares with a neighbour as
    pieces."""
    files = p.parts("urls", "kept", "r", r) + p.parts("hot", "kept", "r", r)
    if not files:
        return {"rows": 0, "shards": 0, "pieces": 0}
    con = _connect(p)
    rel = con.sql(f"SELECT * FROM {_read(files)} ORDER BY key, pos")
    reader = rel.to_arrow_reader(samples_per_shard)
    at, written = offset, {"shards": 0, "pieces": 0}
    buffered: list[pa.RecordBatch] = []

    def flush(table: pa.Table, start: int) -> None:
        table = table.drop_columns(["pos"])
        s = start // samples_per_shard
        whole = start % samples_per_shard == 0 and len(table) == samples_per_shard
        name = f"{shard_name(s)}.parquet" if whole else f"{shard_name(s)}.piece.parquet"
        duck.write_shard(table, tmp / name)
        written["shards" if whole else "pieces"] += 1

    for batch in reader:
        buffered.append(batch)
        table = pa.Table.from_batches(buffered, reader.schema)
        while len(table):
            room = samples_per_shard - at % samples_per_shard
            if len(table) < room:
                break
            flush(table.slice(0, room), at)
            at, table = at + room, table.slice(room)
        buffered = table.to_batches()
    table = pa.Table.from_batches(buffered, reader.schema)
    if len(table):
        flush(table, at)
        at += len(table)
    return {"rows": at - offset} | written


def scatter_task(p: FilterPlan, i: int) -> dict:
    return run_task(p.root, p.folder("scatter", i), _scatter, p, i)


def keys_task(p: FilterPlan, k: int) -> dict:
    return run_task(p.root, p.folder("keys", k), _keys, p, k)


def urls_task(p: FilterPlan, u: int, splitters: list[str]) -> dict:
    return run_task(p.root, p.folder("urls", u), _urls, p, u, splitters)


def hot_task(p: FilterPlan, h: int, splitters: list[str]) -> dict:
    return run_task(p.root, p.folder("hot", h), _hot, p, h, splitters)


def range_task(p: FilterPlan, r: int, offset: int, samples_per_shard: int) -> dict:
    folder = p.root / "ranges" / str(samples_per_shard) / f"{r:05d}"
    return run_task(p.root, folder, _range, p, r, offset, samples_per_shard)


@dataclass(kw_only=True)
class FilterRun:
    """A finished run: every task's record, the waterfall and where the shards lie."""

    plan: FilterPlan
    records: list[dict] = field(default_factory=list)
    peak_temp_bytes: int = 0
    wf: waterfall.Waterfall | None = None
    num_shards: int = 0

    def stage(self, executor: LocalProcesses, fn, calls: list[tuple]) -> list[dict]:
        records = executor.map(fn, calls)
        self.records += records
        self.peak_temp_bytes = max(self.peak_temp_bytes, folder_bytes(self.plan.root))
        return records


def splitters(p: FilterPlan) -> list[str]:
    """num_parts - 1 keys cutting the sampled keys into ranges of equal counts."""
    files = sorted(str(f) for f in p.root.glob("scatter/*/splits.parquet"))
    if not files:
        return []
    keys = pa.concat_tables([pq.read_table(f) for f in files])["key"].to_pylist()
    keys.sort(key=lambda k: k.encode())  # DuckDB orders strings by their UTF-8 bytes
    picks = [keys[len(keys) * j // p.num_parts] for j in range(1, p.num_parts)]
    return sorted(set(picks), key=lambda k: k.encode())


def run_filter(
    p: FilterPlan, samples_per_shard: int, executor: LocalProcesses | None = None
) -> FilterRun:
    """Every stage of plan `p`, each task once (a finished one is reused); leaves the shards
    in `ranges/` and the waterfall on the returned run."""
    executor = executor or LocalProcesses(0)
    run = FilterRun(plan=p)
    parts = range(p.num_parts)
    scattered = run.stage(executor, scatter_task, [(p, i) for i in range(len(p.inputs))])
    keyed = run.stage(executor, keys_task, [(p, k) for k in parts])
    cuts = splitters(p)
    urls = run.stage(executor, urls_task, [(p, u, cuts) for u in parts])
    homes = [h for h in parts if p.parts("scatter", "hot", "upart", h)]
    urls += run.stage(executor, hot_task, [(p, h, cuts) for h in homes])
    counts = np.zeros(p.num_parts, np.int64)
    for folder in [p.folder("urls", u) for u in parts] + [p.folder("hot", h) for h in homes]:
        if (at := folder / "counts.npy").exists():
            counts += np.load(at)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    calls = [(p, r, int(offsets[r]), samples_per_shard) for r in parts if counts[r]]
    run.stage(executor, range_task, calls)
    run.num_shards = math.ceil(int(offsets[-1]) / samples_per_shard)
    run.wf = _waterfall(p, scattered, keyed, urls)
    return run


def _waterfall(p: FilterPlan, scattered, keyed, urls) -> waterfall.Waterfall:
    """The one-node waterfall from the tasks' counts and samples: rule samples are the first in
    file order (inputs in order), duplicate samples the first by key."""
    names = [rule[0] for rule in scattered[0]["rules"]] if scattered else []
    if not scattered:
        names = [r.reason for r in flt.rules(p.profile, available=set(flt.EMPTY_COLUMNS))]
    counts = [
        (name, sum(s["rules"][j][1] for s in scattered), sum(s["rules"][j][2] for s in scattered))
        for j, name in enumerate(names)
    ]
    samples: dict[str, list[dict]] = {}
    for i in range(len(p.inputs)):
        found = json.loads((p.folder("scatter", i) / "samples.json").read_text())
        for reason, rows in found.items():
            samples[reason] = (samples.get(reason, []) + rows)[: waterfall.MAX_SAMPLES]
    key_lost = sum(k["duplicate_key"] for k in keyed)
    counts.append(("duplicate_key", key_lost, key_lost))
    levels = flt.levels(p.profile, "metadata")
    if "url" in levels:
        counts.append(
            ("duplicate_url", *(sum(u["duplicate_url"][j] for u in urls) for j in (0, 1)))
        )
    for level in levels:
        # The one-node order: key (NULL last), then where the row was read.
        pooled = [row for u in urls for row in u["samples"].get(f"duplicate_{level}", [])]
        pooled.sort(key=lambda r: (r[1]["key"] is None, (r[1]["key"] or "").encode(), r[0]))
        samples[f"duplicate_{level}"] = [r[1] for r in pooled[: waterfall.MAX_SAMPLES]]
    num_in = sum(s["rows"] for s in scattered)
    return waterfall.build(
        stage="filter", profile=p.profile.name, num_in=num_in, counts=counts, samples=samples
    )


def commit(run: FilterRun, out_dir: Path, samples_per_shard: int) -> None:
    """The run's shards under `out_dir` as NNNNN.parquet: a whole one linked (copied across
    disks), one spanning ranges joined from its pieces in range order."""
    for old in out_dir.glob("[0-9]*.parquet"):
        old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = run.plan.root / "ranges" / str(samples_per_shard)
    for s in range(run.num_shards):
        name = shard_name(s)
        whole = sorted(folder.glob(f"*/{name}.parquet"))
        with atomic_path(out_dir / f"{name}.parquet") as tmp:
            if whole:
                try:
                    os.link(whole[0], tmp)
                except OSError:
                    shutil.copyfile(whole[0], tmp)
            else:
                pieces = sorted(folder.glob(f"*/{name}.piece.parquet"))
                duck.write_shard(pa.concat_tables(pq.read_table(f) for f in pieces), tmp)


def filter_metadata(
    root: Path,
    source: str,
    profile: FilterProfile,
    samples_per_shard: int,
    *,
    executor: LocalProcesses | None = None,
    memory: int | None = None,
    workdir: Path | None = None,
    hot_rows: int | None = None,
) -> ShardStats:
    """`filter.filter_metadata` as partitioned tasks: the same shards, waterfall and record
    (plus `partitioned`: partitions, tasks, peak task memory, temporary disk). The partition
    files go under `workdir` (default `<root>/<source>/partitions`), removed once committed."""
    out_dir = root / source / "filtered"
    workdir = workdir or root / source / "partitions"
    workers = getattr(executor, "workers", 0) or 1

    def work(stats: ShardStats) -> None:
        files = sorted((root / source / "metadata").glob("*.parquet"))
        plan = make_plan(files, profile, workdir, memory=memory, workers=workers, hot_rows=hot_rows)
        run = run_filter(plan, samples_per_shard, executor)
        commit(run, out_dir, samples_per_shard)
        flt.record(stats, run.wf)
        stats.extra = {
            "num_shards": run.num_shards,
            "profile": profile.name,
            "profile_settings": flt.profile_settings(profile),
            "partitioned": summary(run),
        }
        run.wf.write(out_dir / "waterfall.json", out_dir / "gallery.html")
        shutil.rmtree(plan.root, ignore_errors=True)

    flt.check_profile(root, source, "filtered", profile)
    return run_shard(root, source, "filtered", flt.ALL, work)


def summary(run: FilterRun) -> dict:
    """What the run's record keeps of its tasks."""
    p = run.plan
    cpu = [r["cpu_seconds"] for r in run.records]
    urls = [r["rows"] for r in run.records if r["task"].startswith("urls/")]
    return {
        "partitions": p.num_parts,
        "tasks": len(run.records),
        "reused": sum(bool(r.get("reused")) for r in run.records),
        "task_memory": p.task_memory,
        "task_cpu_seconds": round(sum(cpu), 3),
        "largest_task_share": round(max(cpu, default=0) / max(sum(cpu), 1e-9), 4),
        # The largest urls task's rows over all of theirs (1/partitions when even).
        "largest_urls_rows": max(urls, default=0),
        "largest_urls_share": round(max(urls, default=0) / max(1, sum(urls)), 4),
        "peak_task_rss_gb": max((r["peak_rss_gb"] for r in run.records), default=0.0),
        "temp_bytes": run.peak_temp_bytes,
        "input_bytes": p.input_bytes,
    }
