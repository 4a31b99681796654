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

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tasks.curation.partition_files import (
    LocalProcesses,
    digest,
    file_identity,
    folder_bytes,
    gather,
    run_task,
    save_partitioned,
)
from tasks.curation.phash_dedup import first_table, plan, table_key, table_pairs
from tasks.curation.survivors import DROPPED, SURVIVES, UNDECIDED, settle

ROW = np.dtype([("hash", "<u8"), ("rank", "<i8")])
PAIR = np.dtype([("better", "<i8"), ("worse", "<i8")])
# Rows a task holds at once (its memory: ~100-200 bytes a row at the peak of a sort or table
# pass); the number of partitions follows from it and the rows.
ROWS_PER_TASK = 2_000_000
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

    def layout(self) -> tuple[list, list]:
        """(blocks, tables) of the one-node path's plan for as many hashes."""
        return plan(max(self.num_rows, 2), self.max_distance)

    @property
    def num_tables(self) -> int:
        return len(self.layout()[1]) if self.max_distance > 0 else 0

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
    name = digest(ids, num_ranks, max_distance, rows_per_task, tables_per_pass)
    return PhashPlan(
        root=Path(workdir) / f"phash-{name}",
        inputs=tuple(str(p) for p in inputs),
        num_rows=num_rows,
        num_ranks=num_ranks,
        max_distance=max_distance,
        num_parts=max(1, math.ceil(num_rows / rows_per_task)),
        tables_per_pass=tables_per_pass,
    )


def _small(values: np.ndarray, num: int) -> np.ndarray:
    """Partition numbers in the smallest integer type (numpy radix-sorts 16-bit keys)."""
    return values.astype(np.uint16 if num <= 2**16 else np.int64)


def _bucket(hashes: np.ndarray, num: int) -> np.ndarray:
    top = (hashes * _MIX) >> np.uint64(32)
    return _small((top * np.uint64(num)) >> np.uint64(32), num)


def _best_per_hash(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the best-ranked row of each hash, the ranks of the others: copies, lost whatever the
    best row's fate)."""
    rows = rows[np.lexsort((rows["rank"], rows["hash"]))]
    first = np.ones(len(rows), bool)
    first[1:] = rows["hash"][1:] != rows["hash"][:-1]
    return rows[first], rows["rank"][~first]


def _scatter(tmp: Path, p: PhashPlan, i: int) -> dict:
    rows = np.load(p.inputs[i])
    if len(rows) and (rows["rank"].min() < 0 or rows["rank"].max() >= p.num_ranks):
        raise ValueError(f"{p.inputs[i]}: a rank outside [0, {p.num_ranks})")
    best, lost = _best_per_hash(rows)
    save_partitioned(tmp, "best", best, _bucket(best["hash"], p.num_parts), p.num_parts)
    save_partitioned(tmp, "lost", lost, p.range_of(lost), p.num_parts)
    return {"rows": len(rows), "hashes": len(best), "lost": len(lost)}


def _nodes(tmp: Path, p: PhashPlan, b: int) -> dict:
    rows = gather(p.folders("scatter"), "best", b, ROW)
    nodes, lost = _best_per_hash(rows)
    np.save(tmp / "nodes.npy", nodes)
    save_partitioned(tmp, "lost", lost, p.range_of(lost), p.num_parts)
    return {"rows": len(rows), "nodes": len(nodes), "lost": len(lost)}


def _tables(tmp: Path, p: PhashPlan, pass_: int, b: int) -> dict:
    nodes = np.load(p.folder("nodes", b) / "nodes.npy")
    blocks, tables = p.layout()
    ts = p.pass_tables(pass_)
    num_dest = len(ts) * p.num_parts
    dest = np.empty(len(nodes) * len(ts), np.uint16 if num_dest <= 2**16 else np.int64)
    for j, t in enumerate(ts):
        top = table_key(nodes["hash"], t, blocks, tables) >> np.uint64(32)
        kp = (top * np.uint64(p.num_parts)) >> np.uint64(32)  # the key's range, by its top bits
        dest[j * len(nodes) : (j + 1) * len(nodes)] = kp + j * p.num_parts
    save_partitioned(tmp, "nodes", np.tile(nodes, len(ts)), dest, num_dest)
    return {"nodes": len(nodes), "tables": len(ts)}


def _pairs(tmp: Path, p: PhashPlan, pass_: int, j: int, kp: int) -> dict:
    folders = [p.folder("tables", pass_, b) for b in range(p.num_parts)]
    nodes = gather(folders, "nodes", j * p.num_parts + kp, ROW)
    blocks, tables = p.layout()
    t = p.pass_tables(pass_)[j]
    a, b = table_pairs(
        nodes["hash"], t, blocks, tables, p.max_distance, first_table(blocks, tables)
    )
    ra, rb = nodes["rank"][a], nodes["rank"][b]
    pairs = np.empty(len(a), PAIR)
    pairs["better"], pairs["worse"] = np.minimum(ra, rb), np.maximum(ra, rb)
    save_partitioned(tmp, "pairs", pairs, p.range_of(pairs["worse"]), p.num_parts)
    return {"nodes": len(nodes), "pairs": len(pairs)}


def _pairs_folders(p: PhashPlan) -> list[Path]:
    return [
        p.folder("pairs", pass_, j, kp)
        for pass_ in range(p.num_passes)
        for j in range(len(p.pass_tables(pass_)))
        for kp in range(p.num_parts)
    ]


def _init(tmp: Path, p: PhashPlan, q: int) -> dict:
    lo, hi = p.bounds(q)
    lost = gather(p.folders("scatter") + p.folders("nodes"), "lost", q, np.int64)
    pairs = gather(_pairs_folders(p), "pairs", q, PAIR)
    # A rank in no pair and lost to no copy survives (or was never given: not dropped).
    state = np.full(hi - lo, SURVIVES, np.uint8)
    state[lost - lo] = DROPPED
    state[pairs["worse"] - lo] = UNDECIDED
    np.save(tmp / "state.npy", state)
    np.save(tmp / "open.npy", pairs)
    undecided = int((state == UNDECIDED).sum())
    return {"lost_exact": len(lost), "pairs": len(pairs), "undecided": undecided}


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
    state, pairs = np.load(own / "state.npy"), np.load(own / "open.npy")
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
    np.save(tmp / "open.npy", pairs[still])
    undecided = int((state == UNDECIDED).sum())
    return {
        "pairs": len(pairs),
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
    paths = []
    for i, start in enumerate(range(0, len(hashes), rows_per_file)):
        rows = np.empty(min(rows_per_file, len(hashes) - start), ROW)
        rows["hash"] = hashes[start : start + len(rows)]
        rows["rank"] = rank[start : start + len(rows)]
        path = folder / f"{i:05d}.npy"
        np.save(folder / f"{i:05d}.tmp.npy", rows)
        (folder / f"{i:05d}.tmp.npy").rename(path)
        paths.append(path)
    return paths
