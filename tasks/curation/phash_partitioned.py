"""pHash near-duplicate dedup as many bounded tasks over partition files, deciding exactly as
`tasks.curation.dedup.phash_losers` (distinct hashes, pairs within k bits, the survivor rule).

Stages (each a task per partition, run by an executor; outputs in `partition_files` folders):
scatter (per input file: best row per hash, the rest lost) -> nodes (per hash bucket: one node
per distinct hash, so a hash held by a million rows is one record per input file, never pairs)
-> tables (per pass of a few tables x bucket: nodes by their key's range) -> pairs (per table x
key range: `phash_dedup.table_pairs`, each pair once, as (better, worse) ranks by worse's rank
range) -> init (per rank range: a uint8 state per rank) -> rounds of `survivors.settle`, each
range reading the states of its pairs' better ends from the other ranges' latest slices.
The survivor rule is greedy by rank: its result does not depend on the order rows settle in,
so settling sources first and ranges side by side changes the rounds, not the outcome.
Rows are (hash, rank): rank unique in [0, num_ranks), lower is better (the position in
survivor order, as `dedup.mark` numbers it); rows with no pHash are not given.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from tasks.curation.partition_files import (
    LocalProcesses,
    digest,
    file_identity,
    folder_bytes,
    gather,
    run_task,
    runs_summary,
    save_partitioned,
)
from tasks.curation.phash_dedup import first_table, plan, table_key, table_pairs
from tasks.curation.survivors import DROPPED, SURVIVES, UNDECIDED, settle

ROW = np.dtype([("hash", "<u8"), ("rank", "<i8")])
PAIR_COLUMNS = {"better": np.int64, "worse": np.int64}
# Rows a task holds at once (its memory: ~100-200 bytes a row at the peak of a sort or table
# pass); the number of partitions follows from it and the rows.
ROWS_PER_TASK = 2_000_000
ROWS_PER_TASK_ENV = "SDPIPE_PHASH_TASK_ROWS"  # overrides ROWS_PER_TASK (`rows_per_task`)
TABLES_PER_PASS = 5  # tables whose node copies are on disk at once (16 bytes a node each)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: buckets even for clustered hashes


@dataclass(frozen=True, kw_only=True, slots=True)
class PhashPlan:
    root: Path  # named by the inputs and settings: a rerun finds finished partitions
    inputs: tuple[str, ...]
    num_rows: int
    num_ranks: int
    max_distance: int
    num_parts: int  # hash buckets, key ranges per table and rank ranges alike
    tables_per_pass: int
    blocks: tuple[tuple[int, int], ...]  # the one-node path's plan for as many hashes
    tables: tuple[tuple[int, ...], ...]  # none when max_distance is 0: exact copies only

    def layout(self) -> tuple[list, list]:
        return list(self.blocks), list(self.tables)

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def num_passes(self) -> int:
        return math.ceil(self.num_tables / self.tables_per_pass)

    def pass_tables(self, p: int) -> range:
        return range(p * self.tables_per_pass, min(self.num_tables, (p + 1) * self.tables_per_pass))

    @property
    def range_size(self) -> int:
        return max(1, math.ceil(self.num_ranks / self.num_parts))

    def bounds(self, q: int) -> tuple[int, int]:
        return q * self.range_size, min(self.num_ranks, (q + 1) * self.range_size)

    def range_of(self, ranks: np.ndarray) -> np.ndarray:
        return _small(ranks // self.range_size, self.num_parts)

    def folder(self, stage: str, *index: int) -> Path:
        return self.root.joinpath(stage, *(f"{i:05d}" for i in index))

    def folders(self, stage: str) -> list[Path]:
        count = {"scatter": len(self.inputs), "nodes": self.num_parts}[stage]
        return [self.folder(stage, i) for i in range(count)]


def make_plan(
    inputs: list[str | Path],
    num_ranks: int,
    max_distance: int,
    workdir: Path,
    *,
    rows_per_task: int = ROWS_PER_TASK,
    tables_per_pass: int = TABLES_PER_PASS,
) -> PhashPlan:
    """The partitions for `inputs` (.npy files of ROW records), from their rows and the
    setting `rows_per_task`; the root folder is named by the inputs and settings."""
    num_rows = 0
    for path in inputs:
        array = np.load(path, mmap_mode="r")
        if array.dtype != ROW:
            raise ValueError(f"{path}: records {array.dtype}, expected {ROW}")
        num_rows += len(array)
    ids = [file_identity(p) for p in inputs]
    blocks, tables = plan(max(num_rows, 2), max_distance)
    name = digest(ids, num_ranks, max_distance, rows_per_task, tables_per_pass)
    return PhashPlan(
        root=Path(workdir) / f"phash-{name}",
        inputs=tuple(str(p) for p in inputs),
        num_rows=num_rows,
        num_ranks=num_ranks,
        max_distance=max_distance,
        num_parts=max(1, math.ceil(num_rows / rows_per_task)),
        tables_per_pass=tables_per_pass,
        blocks=tuple(blocks),
        tables=tuple(tables) if max_distance > 0 else (),
    )


def rows_per_task() -> int:
    """Rows a task holds at once: `SDPIPE_PHASH_TASK_ROWS`, else ROWS_PER_TASK."""
    return int(os.environ.get(ROWS_PER_TASK_ENV) or ROWS_PER_TASK)


def _small(values: np.ndarray, num: int) -> np.ndarray:
    """Partition numbers in the smallest integer type (numpy radix-sorts 16-bit keys)."""
    return values.astype(np.uint16 if num <= 2**16 else np.int64)


def _bucket(hashes: np.ndarray, num: int) -> np.ndarray:
    top = (hashes * _MIX) >> np.uint64(32)
    return _small((top * np.uint64(num)) >> np.uint64(32), num)


def _best_per_hash(hashes: np.ndarray, ranks: np.ndarray) -> tuple[dict, np.ndarray]:
    """(the best-ranked row of each hash, sorted by hash; the ranks of the others: copies,
    lost whatever the best row's fate). Ranks are unique: one row of a hash is its best."""
    order = np.argsort(hashes)
    hashes, ranks = hashes[order], ranks[order]
    starts = np.ones(len(hashes), bool)
    starts[1:] = hashes[1:] != hashes[:-1]
    if not len(hashes):
        return {"hash": hashes, "rank": ranks}, ranks
    best = np.minimum.reduceat(ranks, np.flatnonzero(starts))
    is_best = ranks == best[np.cumsum(starts) - 1]
    return {"hash": hashes[starts], "rank": best}, ranks[~is_best]


def _scatter(tmp: Path, p: PhashPlan, i: int) -> dict:
    rows = np.load(p.inputs[i])
    if len(rows) and (rows["rank"].min() < 0 or rows["rank"].max() >= p.num_ranks):
        raise ValueError(f"{p.inputs[i]}: a rank outside [0, {p.num_ranks})")
    best, lost = _best_per_hash(rows["hash"], rows["rank"])
    save_partitioned(tmp, "best", best, _bucket(best["hash"], p.num_parts), p.num_parts)
    save_partitioned(tmp, "lost", {"rank": lost}, p.range_of(lost), p.num_parts)
    return {"rows": len(rows), "hashes": len(best["hash"]), "lost": len(lost)}


def _nodes(tmp: Path, p: PhashPlan, b: int) -> dict:
    rows = gather(p.folders("scatter"), "best", b, {"hash": np.uint64, "rank": np.int64})
    nodes, lost = _best_per_hash(rows["hash"], rows["rank"])
    np.save(tmp / "hash.npy", nodes["hash"])  # sorted: `_ranks_of` finds a hash by bisection
    np.save(tmp / "rank.npy", nodes["rank"])
    save_partitioned(tmp, "lost", {"rank": lost}, p.range_of(lost), p.num_parts)
    return {"rows": len(rows["hash"]), "nodes": len(nodes["hash"]), "lost": len(lost)}


def _tables(tmp: Path, p: PhashPlan, pass_: int, b: int) -> dict:
    hashes = np.load(p.folder("nodes", b) / "hash.npy")
    blocks, tables = p.layout()
    for j, t in enumerate(p.pass_tables(pass_)):
        top = table_key(hashes, t, blocks, tables) >> np.uint64(32)
        kp = _small((top * np.uint64(p.num_parts)) >> np.uint64(32), p.num_parts)  # key range
        save_partitioned(tmp, f"table{j}", {"hash": hashes}, kp, p.num_parts)
    return {"nodes": len(hashes), "tables": len(p.pass_tables(pass_))}


def _ranks_of(p: PhashPlan, hashes: np.ndarray) -> np.ndarray:
    """The node rank of each of `hashes` (all nodes), from its bucket's sorted node file."""
    bucket = _bucket(hashes, p.num_parts)
    out = np.empty(len(hashes), np.int64)
    for b in np.unique(bucket):
        rows = np.flatnonzero(bucket == b)
        folder = p.folder("nodes", int(b))
        at = np.searchsorted(np.load(folder / "hash.npy", mmap_mode="r"), hashes[rows])
        out[rows] = np.load(folder / "rank.npy", mmap_mode="r")[at]
    return out


def _pairs(tmp: Path, p: PhashPlan, pass_: int, j: int, kp: int) -> dict:
    folders = [p.folder("tables", pass_, b) for b in range(p.num_parts)]
    hashes = gather(folders, f"table{j}", kp, {"hash": np.uint64})["hash"]
    blocks, tables = p.layout()
    t = p.pass_tables(pass_)[j]
    k, first = p.max_distance, first_table(blocks, tables)
    a, b = table_pairs(hashes, t, blocks, tables, k, first)
    # Pairs are few (the true ones and chance ones that pass the check): their ranks are
    # looked up, so the tables carry 8 bytes a node, not 16.
    ra, rb = _ranks_of(p, hashes[a]), _ranks_of(p, hashes[b])
    pairs = {"better": np.minimum(ra, rb), "worse": np.maximum(ra, rb)}
    save_partitioned(tmp, "pairs", pairs, p.range_of(pairs["worse"]), p.num_parts)
    return {"nodes": len(hashes), "pairs": len(a)}


def _pairs_folders(p: PhashPlan) -> list[Path]:
    return [
        p.folder("pairs", pass_, j, kp)
        for pass_ in range(p.num_passes)
        for j in range(len(p.pass_tables(pass_)))
        for kp in range(p.num_parts)
    ]


def _init(tmp: Path, p: PhashPlan, q: int) -> dict:
    lo, hi = p.bounds(q)
    lost = gather(p.folders("scatter") + p.folders("nodes"), "lost", q, {"rank": np.int64})["rank"]
    pairs = gather(_pairs_folders(p), "pairs", q, PAIR_COLUMNS)
    # A rank in no pair and lost to no copy survives (or was never given: not dropped).
    state = np.full(hi - lo, SURVIVES, np.uint8)
    state[lost - lo] = DROPPED
    state[pairs["worse"] - lo] = UNDECIDED
    np.save(tmp / "state.npy", state)
    _save_pairs(tmp, pairs)
    undecided = int((state == UNDECIDED).sum())
    return {"lost_exact": len(lost), "pairs": len(pairs["worse"]), "undecided": undecided}


def _save_pairs(folder: Path, pairs: dict) -> None:
    for column, values in pairs.items():
        np.save(folder / f"open.{column}.npy", values)


def _load_pairs(folder: Path) -> dict:
    return {column: np.load(folder / f"open.{column}.npy") for column in PAIR_COLUMNS}


def _states(p: PhashPlan, ranks: np.ndarray, sources: tuple[int, ...]) -> np.ndarray:
    """The states of `ranks` in their ranges' latest slices, one slice mapped at a time."""
    part = p.range_of(ranks)
    order = np.argsort(part, kind="stable")
    edges = np.searchsorted(part[order], np.arange(p.num_parts + 1))
    out = np.empty(len(ranks), np.uint8)
    for g in np.flatnonzero(np.diff(edges)):
        rows = order[edges[g] : edges[g + 1]]
        state = np.load(p.folder("rounds", sources[g], g) / "state.npy", mmap_mode="r")
        out[rows] = state[ranks[rows] - p.bounds(g)[0]]
        del state
    return out


def _round(tmp: Path, p: PhashPlan, r: int, q: int, sources: tuple[int, ...]) -> dict:
    own = p.folder("rounds", sources[q], q)
    state, pairs = np.load(own / "state.npy"), _load_pairs(own)
    from_state = _states(p, pairs["better"], sources)
    worse = pairs["worse"] - p.bounds(q)[0]
    has_survivor = np.zeros(len(state), bool)
    has_undecided = np.zeros(len(state), bool)
    has_survivor[worse[from_state == SURVIVES]] = True
    has_undecided[worse[from_state == UNDECIDED]] = True
    settled = settle(state, has_survivor, has_undecided)
    # A pair matters while its worse end is undecided and its better end is not dropped.
    still = (state[worse] == UNDECIDED) & (from_state != DROPPED)
    np.save(tmp / "state.npy", state)
    _save_pairs(tmp, {column: values[still] for column, values in pairs.items()})
    undecided = int((state == UNDECIDED).sum())
    return {
        "pairs": len(worse),
        "settled": settled,
        "open": int(still.sum()),
        "undecided": undecided,
    }


def scatter_task(p: PhashPlan, i: int) -> dict:
    return run_task(p.root, p.folder("scatter", i), _scatter, p, i)


def nodes_task(p: PhashPlan, b: int) -> dict:
    return run_task(p.root, p.folder("nodes", b), _nodes, p, b)


def tables_task(p: PhashPlan, pass_: int, b: int) -> dict:
    return run_task(p.root, p.folder("tables", pass_, b), _tables, p, pass_, b)


def pairs_task(p: PhashPlan, pass_: int, j: int, kp: int) -> dict:
    return run_task(p.root, p.folder("pairs", pass_, j, kp), _pairs, p, pass_, j, kp)


def init_task(p: PhashPlan, q: int) -> dict:
    return run_task(p.root, p.folder("rounds", 0, q), _init, p, q)


def round_task(p: PhashPlan, r: int, q: int, sources: tuple[int, ...]) -> dict:
    return run_task(p.root, p.folder("rounds", r, q), _round, p, r, q, sources)


@dataclass(kw_only=True)
class PhashRun:
    """A finished run: every task's record, and where each rank range's final state lies."""

    plan: PhashPlan
    records: list[dict] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    rounds: int = 0
    peak_temp_bytes: int = 0

    def dropped_range(self, q: int) -> np.ndarray:
        """bool [ranks of range q]: dropped as a copy (exact or near) of a surviving row."""
        return np.load(self.plan.folder("rounds", self.sources[q], q) / "state.npy") == DROPPED

    def dropped(self) -> np.ndarray:
        """bool [num_ranks] (tests and benches: the whole vector is one byte a rank)."""
        if not self.sources:
            return np.zeros(self.plan.num_ranks, bool)
        return np.concatenate([self.dropped_range(q) for q in range(self.plan.num_parts)])

    def stage(self, executor: LocalProcesses, fn, calls: list[tuple]) -> list[dict]:
        records = executor.map(fn, calls)
        self.records += records
        self.peak_temp_bytes = max(self.peak_temp_bytes, folder_bytes(self.plan.root))
        return records


def run_phash(p: PhashPlan, executor: LocalProcesses | None = None) -> PhashRun:
    """Every stage of plan `p`, each task once (a finished one is reused), then rounds of the
    survivor rule over the ranges still undecided. Progress after each round is a file, so a
    rerun resumes at the last finished round."""
    executor = executor or LocalProcesses(0)
    run = PhashRun(plan=p)
    progress = p.root / "rounds" / "progress.json"
    if progress.exists():
        saved = json.loads(progress.read_text())
        run.rounds, run.sources, undecided = saved["round"], saved["sources"], saved["undecided"]
    else:
        _to_pairs(run, executor)
        init = run.stage(executor, init_task, [(p, q) for q in range(p.num_parts)])
        run.sources, undecided = [0] * p.num_parts, [rec["undecided"] for rec in init]
    while any(undecided):
        run.rounds += 1
        todo = [q for q in range(p.num_parts) if undecided[q]]
        sources = tuple(run.sources)
        calls = [(p, run.rounds, q, sources) for q in todo]
        for q, rec in zip(todo, run.stage(executor, round_task, calls), strict=True):
            run.sources[q], undecided[q] = run.rounds, rec["undecided"]
        _save_progress(progress, run, undecided)
    return run


def _to_pairs(run: PhashRun, executor: LocalProcesses) -> None:
    p = run.plan
    run.stage(executor, scatter_task, [(p, i) for i in range(len(p.inputs))])
    run.stage(executor, nodes_task, [(p, b) for b in range(p.num_parts)])
    for pass_ in range(p.num_passes):
        js = range(len(p.pass_tables(pass_)))
        calls = [(p, pass_, j, kp) for j in js for kp in range(p.num_parts)]
        if not all(p.folder("pairs", *call[1:]).is_dir() for call in calls):
            run.stage(executor, tables_task, [(p, pass_, b) for b in range(p.num_parts)])
        run.stage(executor, pairs_task, calls)
        shutil.rmtree(p.folder("tables", pass_), ignore_errors=True)  # keeps disk to a pass


def _save_progress(path: Path, run: PhashRun, undecided: list[int]) -> None:
    text = json.dumps({"round": run.rounds, "sources": run.sources, "undecided": undecided})
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    tmp.rename(path)
    # Slices no range reads any more (each range's latest is its state).
    keep = {(s, q) for q, s in enumerate(run.sources)}
    for r in range(run.rounds):
        for q in range(run.plan.num_parts):
            if (r, q) not in keep:
                shutil.rmtree(run.plan.folder("rounds", r, q), ignore_errors=True)


def write_inputs(folder: Path, hashes: np.ndarray, rank: np.ndarray, rows_per_file: int) -> list:
    """`hashes` and `rank` as ROW files of `rows_per_file` rows (tests, benches)."""
    folder.mkdir(parents=True, exist_ok=True)
    return [
        write_input(
            folder, i, hashes[start : start + rows_per_file], rank[start : start + rows_per_file]
        )
        for i, start in enumerate(range(0, len(hashes), rows_per_file))
    ]


def write_input(folder: Path, index: int, hashes: np.ndarray, rank: np.ndarray) -> Path:
    """One ROW input file, `<index>.npy`, written under a temporary name."""
    rows = np.empty(len(hashes), ROW)
    rows["hash"], rows["rank"] = hashes, rank
    path = folder / f"{index:05d}.npy"
    np.save(folder / f"{index:05d}.tmp.npy", rows)
    (folder / f"{index:05d}.tmp.npy").rename(path)
    return path


class PartitionedLosers:
    """`dedup.PhashLosers` as `run_phash` on `executor`: a run writes its rows as input files
    under `workdir`, in a folder named by their content, so a rerun after a failure finds the
    same inputs, so the same plan and its finished partitions."""

    def __init__(self, executor, workdir: Path, rows: int | None = None):
        self.executor, self.workdir = executor, Path(workdir)
        self.rows_per_task = rows or rows_per_task()
        self.runs: list[PhashRun] = []
        self.folders: list[Path] = []

    def __call__(
        self, hashes: np.ndarray, rank: np.ndarray, max_distance: int, include: np.ndarray | None
    ) -> np.ndarray:
        """bool [N] as `NearHashes(hashes, max_distance).losers(rank, include)`, every row's
        arrays given at once (tests, benches); filter-pixels streams its rows to `from_rows`."""
        if include is not None:
            hashes, rank = hashes[include], rank[include]
        num_ranks = int(rank.max()) + 1 if len(rank) else 0
        rows = pa.record_batch(
            {"hash": pa.array(hashes, pa.uint64()), "rank": pa.array(rank, pa.int64())}
        )
        dropped = np.zeros(num_ranks, bool)
        for losing in self.from_rows([rows], num_ranks, max_distance):
            dropped[losing] = True
        if include is None:
            return dropped[rank]
        out = np.zeros(len(include), bool)
        out[np.flatnonzero(include)] = dropped[rank]
        return out

    def from_rows(
        self, batches: Iterable[pa.RecordBatch], num_ranks: int, max_distance: int
    ) -> Iterator[np.ndarray]:
        """The ranks that lose among the rows of `batches` (columns `hash` uint64, `rank`
        int64, each rank < `num_ranks`), range by range, ascending (int64). The rows go
        straight from the batches to input files: this process holds a task's rows at most,
        and the ranks that lose, where `__call__` takes every row's hash and rank at once."""
        inputs = self._stream_inputs(batches)
        if not inputs:
            return
        p = make_plan(
            inputs, num_ranks, max_distance, self.workdir, rows_per_task=self.rows_per_task
        )
        self.folders.append(p.root)
        run = run_phash(p, self.executor)
        self.runs.append(run)
        for q in range(p.num_parts if run.sources else 0):
            yield p.bounds(q)[0] + np.flatnonzero(run.dropped_range(q))

    def _stream_inputs(self, batches: Iterable[pa.RecordBatch]) -> list[Path]:
        """Input files of `rows_per_task` rows written as the batches come, in a folder named by
        their content (kept where a run before wrote the same: its plan's partitions reused)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="phash-inputs.tmp-", dir=self.workdir))
        # Named by the rows, not by how they were batched: one digest a column.
        of_hashes, of_ranks, held, count, files = hashlib.sha256(), hashlib.sha256(), [], 0, 0
        try:
            for batch in batches:
                hashes = batch.column("hash").to_numpy().astype(np.uint64, copy=False)
                ranks = batch.column("rank").to_numpy().astype(np.int64, copy=False)
                of_hashes.update(hashes.tobytes())
                of_ranks.update(ranks.tobytes())
                held.append((hashes, ranks))
                count += len(hashes)
                while count >= self.rows_per_task:
                    held, count = self._write_input(tmp, files, held, self.rows_per_task)
                    files += 1
            if count:
                self._write_input(tmp, files, held, count)
                files += 1
            name = hashlib.sha256(of_hashes.digest() + of_ranks.digest()).hexdigest()[:16]
            folder = self.workdir / f"phash-inputs-{name}-{self.rows_per_task}"
            self.folders.append(folder)
            if files and not folder.is_dir():  # renamed whole: a folder there is complete
                tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return sorted(folder.glob("[0-9]*.npy")) if files else []

    @staticmethod
    def _write_input(folder: Path, index: int, held: list, rows: int) -> tuple[list, int]:
        """The first `rows` held rows as input file `index`; what is left held, and its count."""
        hashes = np.concatenate([h for h, _ in held])
        ranks = np.concatenate([r for _, r in held])
        write_input(folder, index, hashes[:rows], ranks[:rows])
        left = len(hashes) - rows
        return ([(hashes[rows:], ranks[rows:])] if left else []), left

    def summary(self) -> dict:
        """What the stage's record keeps of its runs (one over every row, one over the kept)."""
        return runs_summary(self.runs)

    def cleanup(self) -> None:
        """Removes the partition files and inputs (once the stage that used them is done)."""
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
