"""Semantic dedup (SemDeDup) as many bounded tasks over partition files, deciding exactly as
`semantic_dedup.SemanticIndex` given the same centroids (k-means fitted once, on a sample).

map (per input file: each row's cluster and the clusters it visits, as `semantic_dedup.assign`;
rows written by cluster) -> init (per row range: a state per row) -> rounds of: scan (per group
of whole clusters, or per block pair of a cluster over `slots_per_task`: the cluster's visitor
cap and rank order, then `flag_duplicates`, as the one-node `_scan`) and settle (per row range:
`survivors.settle` on every scan's flags). A row also visits up to `max_visits` clusters, so
clusters do not settle alone: the rule settles in rounds over row ranges (the pHash core's).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sdtrain.atomic import atomic_path
from tasks.curation.partition_files import (
    LocalProcesses,
    digest,
    file_identity,
    gather,
    read_part,
    run_task,
    runs_summary,
    save_partitioned,
)
from tasks.curation.phash_partitioned import PhashRun, _save_progress, _states
from tasks.curation.semantic_dedup import (
    ASSIGN_ROWS,
    CPU,
    Centroids,
    Parts,
    assign,
    fit_seeded,
    flag_duplicates,
    num_clusters_for,
    screen,
    unit,
    visitor_caps,
)
from tasks.curation.survivors import ABSENT, UNDECIDED, settle

# Rows of a cluster a scan task holds at once (~6 D bytes each: fp16 as stored, fp32 screened;
# two blocks for a block pair); a larger cluster is split into blocks of this many.
SLOTS_PER_TASK = 65536
# Overrides SLOTS_PER_TASK in a build, and the rows of an input file (a map task's) with it.
TASK_ROWS_ENV = "SDPIPE_SEMANTIC_TASK_ROWS"
ROWS_PER_RANGE = 2_000_000  # rows per state slice (1 byte each) of the survivor rule
META = {"row": np.int64, "rank": np.int64, "visit": np.int8, "gap": np.float32}


def input_dtype(dim: int) -> np.dtype:
    """An input row: its id (unique, in [0, num_ids): the one-node path's row), its rank (lower
    is better; ties: the lower id) and its embedding (any norm; NaN or zero: none)."""
    return np.dtype([("row", "<i8"), ("rank", "<i8"), ("emb", "<f2", (dim,))])


@dataclass(frozen=True, kw_only=True, slots=True)
class SemanticPlan:
    root: Path  # named by the inputs, centroids and settings: a rerun finds finished tasks
    inputs: tuple[str, ...]
    num_ids: int
    dim: int
    threshold: float
    max_visits: int
    num_clusters: int
    num_parts: int  # row ranges
    slots_per_task: int
    # Rows laid out with the others but judged absent (never dropped, never a survivor): the
    # rows an earlier level dropped, as `SemanticIndex.losers(include)` leaves them out.
    absent: str | None = None

    @property
    def num_ranks(self) -> int:  # the pHash rounds' helpers index states by rank; here by id
        return self.num_ids

    @property
    def range_size(self) -> int:
        return max(1, math.ceil(self.num_ids / self.num_parts))

    def bounds(self, q: int) -> tuple[int, int]:
        return q * self.range_size, min(self.num_ids, (q + 1) * self.range_size)

    def range_of(self, rows: np.ndarray) -> np.ndarray:
        return (rows // self.range_size).astype(np.int64)

    def folder(self, stage: str, *index: int) -> Path:
        return self.root.joinpath(stage, *(f"{i:05d}" for i in index))

    def maps(self) -> list[Path]:
        return [self.folder("map", i) for i in range(len(self.inputs))]

    def centroids(self) -> Centroids:
        return Centroids(
            torch.from_numpy(np.load(self.root / "centroids.npy")),
            torch.from_numpy(np.load(self.root / "center.npy")),
        )


def make_plan(
    inputs: list[str | Path],
    num_ids: int,
    threshold: float,
    centroids: Centroids,
    workdir: Path,
    *,
    max_visits: int = 2,
    rows_per_range: int = ROWS_PER_RANGE,
    slots_per_task: int = SLOTS_PER_TASK,
    absent: str | Path | None = None,
) -> SemanticPlan:
    """The tasks for `inputs` (.npy files of `input_dtype` rows) at these centroids; the root
    folder is named by the inputs, centroids and settings, and holds the centroids. `absent`:
    a .npy of sorted int64 row ids that are laid out but not judged (see `SemanticPlan`)."""
    dim = centroids.centroids.shape[1]
    for path in inputs:
        array = np.load(path, mmap_mode="r")
        if array.dtype != input_dtype(dim):
            raise ValueError(f"{path}: records {array.dtype}, expected {input_dtype(dim)}")
    arrays = [centroids.centroids.float().numpy(), centroids.center.float().numpy()]
    fingerprint = hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()[:16]
    settings = [num_ids, threshold, max_visits, rows_per_range, slots_per_task, fingerprint]
    if absent is not None:
        settings.append(file_identity(absent))
    root = Path(workdir) / f"semantic-{digest([file_identity(p) for p in inputs], settings)}"
    root.mkdir(parents=True, exist_ok=True)
    for name, array in zip(("centroids", "center"), arrays, strict=True):
        if not (root / f"{name}.npy").exists():
            np.save(root / f"{name}.tmp.npy", array)
            (root / f"{name}.tmp.npy").rename(root / f"{name}.npy")
    k = len(arrays[0])
    return SemanticPlan(
        root=root,
        inputs=tuple(str(p) for p in inputs),
        num_ids=num_ids,
        dim=dim,
        threshold=threshold,
        max_visits=min(max_visits, k - 1),
        num_clusters=k,
        num_parts=max(1, math.ceil(num_ids / rows_per_range)),
        slots_per_task=slots_per_task,
        absent=None if absent is None else str(absent),
    )


def _map(tmp: Path, p: SemanticPlan, i: int) -> dict:
    rows = np.load(p.inputs[i])
    if len(rows) and (rows["row"].min() < 0 or rows["row"].max() >= p.num_ids):
        raise ValueError(f"{p.inputs[i]}: a row id outside [0, {p.num_ids})")
    bits = rows["emb"].view(np.uint16)  # fp16 as bits: numpy's fp16 arithmetic is slow
    has = ((bits & 0x7C00) != 0x7C00).all(1) & ((bits & 0x7FFF) != 0).any(1)  # finite, not 0
    rows = rows[has]
    emb = np.ascontiguousarray(rows["emb"])  # as the one-node path's parts give it
    m, n = p.max_visits, len(rows)
    primary = np.zeros(n, np.int64)
    visits, gap = np.full((n, m), -1, np.int64), np.zeros((n, m), np.float32)
    if p.num_clusters > 1:
        given = p.centroids()
        reach = math.sqrt(max(0.0, 2 - 2 * p.threshold))
        for start in range(0, n, ASSIGN_ROWS):
            y = unit(emb[start : start + ASSIGN_ROWS], CPU) - given.center
            nearest, visited, to_bisector, _ = assign(y, given.centroids, reach, m)
            primary[start : start + ASSIGN_ROWS] = nearest.numpy()
            visits[start : start + ASSIGN_ROWS] = visited.numpy()
            gap[start : start + ASSIGN_ROWS] = to_bisector.numpy()
    # Entries: a row in its own cluster (visit 0), then in each it visits (1..m).
    clusters = np.concatenate([primary[:, None], visits], axis=1)
    row, visit = np.nonzero(clusters >= 0)
    cluster = clusters[row, visit]
    entries = {
        "row": rows["row"][row],
        "rank": rows["rank"][row],
        "visit": visit.astype(np.int8),
        "gap": np.concatenate([np.zeros((n, 1), np.float32), gap], axis=1)[row, visit],
        "emb": emb[row],
    }
    save_partitioned(tmp, "slots", entries, cluster, p.num_clusters)
    given_rows = {"row": rows["row"]}
    save_partitioned(tmp, "given", given_rows, p.range_of(rows["row"]), p.num_parts)
    return {"rows": len(has), "embedded": n, "no_embedding": int((~has).sum()), "slots": len(row)}


def pieces(p: SemanticPlan) -> list[tuple[int, int, int, int]]:
    """The scan tasks, (first cluster, past the last, query block, ref block): runs of whole
    clusters of up to `slots_per_task` slots (blocks -1), and each larger cluster as its block
    pairs (ref block <= query block; the blocks of `slots_per_task` slots in rank order)."""
    counts = np.zeros(p.num_clusters, np.int64)  # before the visitor caps: an upper bound
    for folder in p.maps():
        counts += np.diff(np.load(folder / "slots.offsets.npy"))
    out, start, held = [], 0, 0
    for c, count in enumerate(counts.tolist()):
        if held and held + count > p.slots_per_task:
            out.append((start, c, -1, -1))
            start, held = c, 0
        if count > p.slots_per_task:
            blocks = math.ceil(count / p.slots_per_task)
            out += [(c, c + 1, qb, rb) for qb in range(blocks) for rb in range(qb + 1)]
            start = c + 1
        else:
            held += count
    if held:
        out.append((start, p.num_clusters, -1, -1))
    return out


def _slots(p: SemanticPlan, c0: int, c1: int, num_embedded: int) -> dict:
    """The slots of clusters c0..c1-1 as the one-node layout has them: each cluster's own rows
    and the visitors nearest its border up to its cap (ties: the lower id), ordered by cluster,
    rank, id; with where each lies (`folder`, `at`: its place in that folder's file)."""
    parts = []
    for f, folder in enumerate(p.maps()):
        offsets = np.load(folder / "slots.offsets.npy")
        part = read_part(folder, "slots", c0, list(META), stop=c1)
        part["cluster"] = np.repeat(np.arange(c0, c1), np.diff(offsets[c0 : c1 + 1]))
        part["folder"] = np.full(len(part["row"]), f)
        part["at"] = np.arange(offsets[c0], offsets[c1])
        parts.append(part)
    slots = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    own = slots["visit"] == 0
    primaries = np.bincount(slots["cluster"][own] - c0, minlength=c1 - c0)
    cap = visitor_caps(primaries, num_embedded, p.num_clusters)
    visitor = np.flatnonzero(~own)
    order = visitor[np.lexsort([slots[key][visitor] for key in ("row", "gap", "cluster")])]
    cluster = slots["cluster"][order]
    place = np.arange(len(order)) - np.searchsorted(cluster, cluster)
    keep = np.concatenate([np.flatnonzero(own), order[place < cap[cluster - c0]]])
    keep = keep[np.lexsort([slots[key][keep] for key in ("row", "rank", "cluster")])]
    return {key: values[keep] for key, values in slots.items()}


def _embeddings(p: SemanticPlan, slots: dict, pick: np.ndarray, whole: bool) -> np.ndarray:
    """fp16 [len(pick), D]: the embeddings of slots `pick`, read from their map folders: the
    span they lie in, read whole (`whole`: a group's clusters), or row by row (a block's)."""
    out = np.empty((len(pick), p.dim), np.float16)
    folder, at = slots["folder"][pick], slots["at"][pick]
    for f in np.unique(folder):
        mine = np.flatnonzero(folder == f)
        mine = mine[np.argsort(at[mine])]  # in file order
        data = np.load(p.maps()[f] / "slots.emb.npy", mmap_mode="r")
        if whole:
            lo = at[mine[0]]
            out[mine] = np.array(data[lo : at[mine[-1]] + 1])[at[mine] - lo]
        else:
            out[mine] = data[at[mine]]
        del data
    return out


def _scan(tmp: Path, p: SemanticPlan, r: int, piece: tuple, num_embedded: int, sources) -> dict:
    c0, c1, qb, rb = piece
    slots = _slots(p, c0, c1, num_embedded)
    slots["state"] = _states(p, slots["row"], sources)
    dtype, margin = screen(CPU)
    flags = ([], [])  # positions in `slots`: a better duplicate survives / is undecided
    is_undecided = slots["state"] == UNDECIDED
    if qb < 0:  # whole clusters, one at a time (as the one-node `losers` scans them)
        edges = np.searchsorted(slots["cluster"], np.arange(c0, c1 + 1))
        runs = [(np.arange(a, b), None) for a, b in zip(edges[:-1], edges[1:], strict=True)]
        # The group's slots lie in one span per map folder: read in one piece each.
        every = np.arange(len(is_undecided))
        group = _embeddings(p, slots, every, whole=True) if is_undecided.any() else None
    else:  # one block pair of one cluster: better block, then worse
        size = p.slots_per_task
        query = np.arange(qb * size, min((qb + 1) * size, len(is_undecided)))
        ref = np.arange(rb * size, min((rb + 1) * size, len(is_undecided)))
        runs = [(query, None)] if qb == rb else [(np.concatenate([ref, query]), len(ref))]
    queries = 0
    for pick, split in runs:
        asked = int(is_undecided[pick[split or 0 :]].sum())
        queries += asked
        if not asked:
            continue  # nothing to read
        store = group[pick] if qb < 0 else _embeddings(p, slots, pick, whole=False)
        state = slots["state"][pick]
        found = flag_duplicates(store, state, p.threshold, margin, dtype, CPU, split)
        for out, at in zip(flags, found, strict=True):
            out.append(pick[at])
    none = np.zeros(0, np.int64)
    survivor, undecided = (slots["row"][np.concatenate([none, *f])] for f in flags)
    for name, rows in (("survivor", survivor), ("undecided", undecided)):
        save_partitioned(tmp, name, {"row": rows}, p.range_of(rows), p.num_parts)
    # Queries whose only better duplicates here wait: this task must look again next round.
    waiting = np.setdiff1d(undecided, survivor)
    return {"slots": len(slots["row"]), "queries": queries, "waiting": len(waiting)}


def _init(tmp: Path, p: SemanticPlan, q: int) -> dict:
    lo, hi = p.bounds(q)
    given = gather(p.maps(), "given", q, {"row": np.int64})["row"]
    if len(np.unique(given)) != len(given):
        raise ValueError(f"rows {lo}..{hi - 1}: a row id given twice")
    state = np.full(hi - lo, ABSENT, np.uint8)  # a row with no embedding is never dropped
    state[given - lo] = UNDECIDED
    if p.absent is not None:
        absent = np.load(p.absent, mmap_mode="r")
        mine = np.asarray(absent[np.searchsorted(absent, lo) : np.searchsorted(absent, hi)])
        state[mine - lo] = ABSENT
    np.save(tmp / "state.npy", state)
    return {"rows": len(given), "undecided": int((state == UNDECIDED).sum())}


def _settle(tmp: Path, p: SemanticPlan, r: int, q: int, sources, scanned) -> dict:
    lo, hi = p.bounds(q)
    state = np.load(p.folder("rounds", sources[q], q) / "state.npy")
    folders = [p.folder("scans", r, j) for j in scanned]
    flags = []
    for name in ("survivor", "undecided"):
        flag = np.zeros(hi - lo, bool)
        flag[gather(folders, name, q, {"row": np.int64})["row"] - lo] = True
        flags.append(flag)
    settled = settle(state, *flags)
    np.save(tmp / "state.npy", state)
    return {"settled": settled, "undecided": int((state == UNDECIDED).sum())}


def map_task(p: SemanticPlan, i: int) -> dict:
    return run_task(p.root, p.folder("map", i), _map, p, i)


def init_task(p: SemanticPlan, q: int) -> dict:
    return run_task(p.root, p.folder("rounds", 0, q), _init, p, q)


def scan_task(p: SemanticPlan, r: int, j: int, piece: tuple, num_embedded: int, sources) -> dict:
    return run_task(p.root, p.folder("scans", r, j), _scan, p, r, piece, num_embedded, sources)


def settle_task(p: SemanticPlan, r: int, q: int, sources, scanned) -> dict:
    return run_task(p.root, p.folder("rounds", r, q), _settle, p, r, q, sources, scanned)


def run_semantic(p: SemanticPlan, executor: LocalProcesses | None = None) -> PhashRun:
    """Every task of plan `p` (a finished one is reused), then rounds of scans and settles until
    no row is undecided. A round scans only the tasks that had a query waiting (the others
    found every better duplicate of theirs dropped or surviving: they would flag nothing new).
    Progress after each round is a file, so a rerun resumes at the last finished round."""
    executor = executor or LocalProcesses(0)
    run = PhashRun(plan=p)
    maps = run.stage(executor, map_task, [(p, i) for i in range(len(p.inputs))])
    num_embedded = sum(rec["embedded"] for rec in maps)
    todo = pieces(p)
    progress = p.root / "rounds" / "progress.json"
    if progress.exists():
        saved = _load_json(progress)
        run.rounds, run.sources, undecided = saved["round"], saved["sources"], saved["undecided"]
        waiting = set(_load_json(p.root / "rounds" / f"waiting-{run.rounds}.json"))
    else:
        init = run.stage(executor, init_task, [(p, q) for q in range(p.num_parts)])
        run.sources, undecided = [0] * p.num_parts, [rec["undecided"] for rec in init]
        waiting = set(range(len(todo)))
    while any(undecided):
        run.rounds += 1
        _remove_scans(p, before=run.rounds)  # earlier rounds' flags
        sources = tuple(run.sources)
        scanned = sorted(waiting)
        calls = [(p, run.rounds, j, todo[j], num_embedded, sources) for j in scanned]
        scans = run.stage(executor, scan_task, calls)
        waiting = {j for j, rec in zip(scanned, scans, strict=True) if rec["waiting"]}
        ranges = [q for q in range(p.num_parts) if undecided[q]]
        calls = [(p, run.rounds, q, sources, tuple(scanned)) for q in ranges]
        for q, rec in zip(ranges, run.stage(executor, settle_task, calls), strict=True):
            run.sources[q], undecided[q] = run.rounds, rec["undecided"]
        _save_json(p.root / "rounds" / f"waiting-{run.rounds}.json", sorted(waiting))
        _save_progress(progress, run, undecided)
    _remove_scans(p, before=run.rounds + 1)
    return run


def _remove_scans(p: SemanticPlan, before: int) -> None:
    """The scans' flags of rounds before `before` (a settled round's; a rerun of an unsettled
    one finds its own, and the temporary folders a killed task left, through `run_task`)."""
    for folder in (p.root / "scans").glob("[0-9]*"):
        if folder.name.isdigit() and int(folder.name) < before:
            shutil.rmtree(folder, ignore_errors=True)


def _load_json(path: Path):
    return json.loads(path.read_text())


def _save_json(path: Path, value) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


def write_inputs(folder: Path, x: np.ndarray, rank: np.ndarray, rows_per_file: int) -> list:
    """Rows of embeddings `x` (ids: their positions) and `rank` as `input_dtype` files of
    `rows_per_file` rows (tests, benches)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, start in enumerate(range(0, len(x), rows_per_file)):
        rows = np.empty(min(rows_per_file, len(x) - start), input_dtype(x.shape[1]))
        rows["row"] = np.arange(start, start + len(rows))
        rows["rank"] = rank[start : start + len(rows)]
        rows["emb"] = x[start : start + len(rows)]
        np.save(folder / f"{i:05d}.tmp.npy", rows)
        (folder / f"{i:05d}.tmp.npy").rename(folder / f"{i:05d}.npy")
        paths.append(folder / f"{i:05d}.npy")
    return paths


def task_rows() -> int:
    """Rows (slots) a task holds at once: `SDPIPE_SEMANTIC_TASK_ROWS`, else SLOTS_PER_TASK."""
    return int(os.environ.get(TASK_ROWS_ENV) or SLOTS_PER_TASK)


class PartitionedSemantic:
    """`dedup.SemanticLosers` as `run_semantic` on `executor`, deciding as `SemanticIndex` does:
    the centroids are fitted as it fits them (`fit_seeded`: the same sample, seed and k-means,
    on `device`; none below SMALL rows), the rows are the parts' rows (id = row, rank as given)
    and a call over a subset lays out every row, the others absent, as `losers(include)` does.
    Inputs go under `workdir` in a folder named by their content, so a rerun after a failure
    finds the same plan and its finished tasks. Not computed here: the one-node path's missed-
    duplicate estimate (`SemanticIndex.estimate_missed`), which needs every row's reach."""

    def __init__(self, executor, workdir: Path, rows: int | None = None):
        self.executor, self.workdir = executor, Path(workdir)
        self.rows = rows or task_rows()
        self.runs: list[PhashRun] = []
        self.folders: list[Path] = []
        self._prepared: tuple | None = None  # (parts, inputs, centroids) of the last call

    def __call__(
        self,
        parts: Parts,
        rank: np.ndarray,
        threshold: float,
        max_visits: int,
        include: np.ndarray | None,
        device: str | torch.device | None = None,
    ) -> np.ndarray:
        if not parts.num_rows:
            return np.zeros(0, bool)
        inputs, centroids = self._prepare(parts, np.asarray(rank, np.int64), device)
        absent = None if include is None else self._absent(~np.asarray(include, bool))
        p = make_plan(
            inputs,
            parts.num_rows,
            threshold,
            centroids,
            self.workdir,
            max_visits=max_visits,
            rows_per_range=ROWS_PER_RANGE,
            slots_per_task=self.rows,
            absent=absent,
        )
        self.folders.append(p.root)
        run = run_semantic(p, self.executor)
        self.runs.append(run)
        return run.dropped()

    def _prepare(self, parts: Parts, rank: np.ndarray, device) -> tuple[list[Path], Centroids]:
        if self._prepared is not None and self._prepared[0] is parts:
            return self._prepared[1:]
        n = parts.num_rows
        k = min(n, num_clusters_for(n)) or 1  # as `SemanticIndex`
        if k == 1:  # one cluster: the one-node path fits none, and reads no centroid
            zeros = torch.zeros(1, parts.dim)
            centroids = Centroids(zeros, zeros[0])
        else:
            on = torch.device(device or "cpu")
            fitted, _ = fit_seeded(parts, k, screen(on)[0], device=on)
            centroids = Centroids(fitted.centroids.cpu(), fitted.center.cpu())
        inputs = self._inputs(parts, rank)
        self._prepared = (parts, inputs, centroids)
        return inputs, centroids

    def _inputs(self, parts: Parts, rank: np.ndarray) -> list[Path]:
        """The parts' rows as `input_dtype` files of `self.rows` rows, in a folder named by
        their content (written whole under a temporary name: present is complete)."""
        tmp = self.workdir / f"semantic-inputs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        name, held, count, written = hashlib.sha256(), [], 0, 0
        dtype = input_dtype(parts.dim)

        def flush() -> None:
            nonlocal written
            rows = np.concatenate(held) if held else np.zeros(0, dtype)
            np.save(tmp / f"{written:05d}.npy", rows)
            written += 1
            held.clear()

        for read in parts.readers:
            ids, emb = read()
            rows = np.empty(len(ids), dtype)
            rows["row"], rows["rank"], rows["emb"] = ids, rank[ids], emb
            name.update(rows.tobytes())
            held.append(rows)
            count += len(rows)
            if count >= self.rows:
                flush()
                count = 0
        if held:
            flush()
        folder = self.workdir / f"semantic-inputs-{name.hexdigest()[:16]}-{self.rows}"
        self.folders.append(folder)
        if folder.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.rename(folder)
        return sorted(folder.glob("[0-9]*.npy"))

    def _absent(self, excluded: np.ndarray) -> Path:
        """The excluded rows' ids as a file named by its content (`make_plan`'s `absent`)."""
        ids = np.flatnonzero(excluded).astype(np.int64)
        name = hashlib.sha256(ids.tobytes()).hexdigest()[:16]
        path = self.workdir / f"semantic-absent-{name}.npy"
        self.folders.append(path)
        if not path.exists():
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.save(f, ids)
        return path

    def summary(self) -> dict:
        """What the stage's record keeps of its runs (one over every row, one over the kept)."""
        clusters = [run.plan.num_clusters for run in self.runs]
        return {"clusters": clusters} | runs_summary(self.runs)

    def cleanup(self) -> None:
        """Removes the partition files, inputs and absent lists (once their stage is done)."""
        for path in self.folders:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
