"""Semantic duplicates at scale, as SemDeDup: k-means, then pairs only within a cluster.

Embeddings stream from their parts (a score shard each) twice: once to assign rows to their
nearest centroid (a row near a boundary also visits the next nearest, up to `max_visits`, so
a pair the boundary splits still meets), once to copy them into a cluster-ordered fp16 file;
memory holds a part and a cluster, never the set. Similarities are screened in bf16/fp16 and
every one near the threshold is confirmed in float64: CPU and GPU make the same decisions.
Only a row with a centroid within reach that it does not visit can miss a duplicate: they
are counted (`beyond_visits`; nearly every row of CLIP-like data) and a seeded sample of them
is searched in those clusters (`estimate_missed`), which estimates the rows that did.

Bytes per row, N rows of dimension D, m = `max_visits` (the profile's `semantic_visits`), v the
mean visits a row makes (<= m; 1.14 at 1M CLIP-like rows, m = 2), S = N (1 + v) slots:
- the cluster-ordered store (disk, `SDPIPE_SEMANTIC_TEMP`): fp16, 2 D per slot, so 2 D (1 + v)
  per row: ~3,290 B at D = 768, v = 1.14; at most 2 D (1 + m) = 4,608 B. It is written in
  sequence (`tasks.curation.semantic_store`): runs of (slot int64, row) records, 8 + 2 D per
  slot, become the store a bucket at a time, so the folder holds at most (8 + 2 D) (1 + v)
  per row plus a bucket: ~3,300 B at D = 768, v = 1.14 (`temp_bytes`, measured).
- the index, held for the stage: `slot_row` int64 + `slot_cluster` int32 per slot (12 (1 + v)),
  `primary_slot` int64 (8) and `visitor_slot` int64 x m (8 m) per row, and `losers`' int8
  state and three bool masks (4): 24 + 8 m + 12 v = 54 B at m = 2, v = 1.14.
- while it is built, besides: nearest and visits int32, gaps float32 and the at-risk flag
  (5 + 8 m), the centroids' distances (k x k float32: 4 B per row at k = sqrt N), then the
  slots' sort (cluster, rank, key, order, inverse: int64, 40 per slot) and the visits' row
  and column (int64, 16 v): ~110 B more at the peak, on top of the caller's rank (int64, 8)
  and the order and dense rank (int64, 16). Rows are assigned 16,384 at a time: their scores,
  distances, gaps and reach flags take 13 k B each (210 MB at k = 1,000; 2.1 GB at 100M rows).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tasks.curation.semantic_store import cluster_ordered
from tasks.curation.survivors import ABSENT, DROPPED, SURVIVES, UNDECIDED, settle

Reader = Callable[[], tuple[np.ndarray, np.ndarray]]  # -> (row int64 [b], embedding fp16 [b, D])
SMALL = 4096  # rows compared all pairs, no clustering
SAMPLE_PER_CLUSTER = 40  # k-means training rows per centroid
VISITOR_SHARE = 2  # visitors a cluster takes, per row of its own
MISS_SAMPLE = 2000  # rows at risk searched for a missed duplicate (`estimate_missed`)
SAMPLE_BLOCK = 2048  # of those rows, compared with a cluster's block at once
KMEANS_ITERS = 10
QUERY_BLOCK, REF_BLOCK = 256, 4096  # rows per similarity block
ASSIGN_ROWS = 16384  # rows given their clusters at once
CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Parts:
    """Embeddings of `num_rows` rows, readable part by part (each row in exactly one part)."""

    num_rows: int
    dim: int
    readers: Sequence[Reader]

    @classmethod
    def from_array(cls, x_ND: np.ndarray, part_rows: int = 65536) -> Parts:
        def read(start: int) -> tuple[np.ndarray, np.ndarray]:
            stop = min(start + part_rows, len(x_ND))
            return np.arange(start, stop), np.asarray(x_ND[start:stop], np.float16)

        starts = range(0, len(x_ND), part_rows)
        return cls(len(x_ND), x_ND.shape[1], [functools.partial(read, s) for s in starts])


BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")  # CPUs that multiply bf16 natively


@functools.cache
def _cpu_screen_dtype() -> torch.dtype:
    """bf16 where this CPU multiplies it natively (AVX512-BF16, AMX), else fp32: a fixed choice
    per machine. (It was a timing of both, which the machine's load decided: the dtype also
    sets k-means' precision, so the clusters, and the rare pair they miss, changed with load.)"""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split()}
    except OSError:  # not Linux: no way to tell, the exact path
        return torch.float32
    return torch.bfloat16 if flags & set(BF16_MATMUL_FLAGS) else torch.float32


def screen(device: torch.device) -> tuple[torch.dtype, float]:
    """(dtype, margin): similarities of unit vectors in `dtype` are within `margin` of exact
    (input and output rounding: 3 units of the last place for bf16, plus fp16's reduced-precision
    reductions on CUDA), so every pair at or above `threshold - margin` is confirmed."""
    if device.type == "cuda":
        return torch.float16, 0.02
    dtype = _cpu_screen_dtype()
    return dtype, 0.03 if dtype == torch.bfloat16 else 1e-4


def num_clusters_for(num_rows: int) -> int:
    """~sqrt(N) clusters: assigning costs N x k, comparing within clusters N x N / k."""
    return 1 if num_rows <= SMALL else round(math.sqrt(num_rows))


def _scores(x_ND: torch.Tensor, centroids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x . c - |c|^2 / 2 for every centroid: the larger, the nearer (Euclidean)."""
    half = (centroids.float() ** 2).sum(1) / 2
    return (x_ND.to(dtype) @ centroids.to(dtype).T).float() - half


def kmeans(
    x_ND: torch.Tensor, k: int, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Euclidean k-means of `x_ND` (float32); returns centroids [k, D] (float32)."""
    pick = torch.randperm(len(x_ND), generator=generator)[:k].to(x_ND.device)
    centroids = x_ND[pick].clone()
    for _ in range(KMEANS_ITERS):
        nearest = torch.cat([_scores(x, centroids, dtype).argmax(1) for x in x_ND.split(16384)])
        sums = torch.zeros_like(centroids).index_add_(0, nearest, x_ND)
        counts = torch.bincount(nearest, minlength=k)
        empty = (counts == 0).nonzero().flatten()
        if len(empty):  # an empty cluster restarts at a random row
            reseed = torch.randint(len(x_ND), (len(empty),), generator=generator)
            sums[empty] = x_ND[reseed.to(x_ND.device)]
            counts[empty] = 1
        centroids = sums / counts[:, None]
    return centroids


@dataclass(frozen=True, slots=True)
class Centroids:
    """k-means centroids of unit rows less `center` (the sample's mean): the clusters. Given the
    same centroids, the one-node and partitioned paths make the same decisions."""

    centroids: torch.Tensor  # float32 [k, D]
    center: torch.Tensor  # float32 [D]


def unit(emb: np.ndarray, device: torch.device) -> torch.Tensor:
    return F.normalize(torch.from_numpy(emb).to(device).float(), dim=1)


def fit_centroids(
    parts: Parts,
    k: int,
    dtype: torch.dtype,
    rng: np.random.Generator,
    generator: torch.Generator,
    device: torch.device | None = None,
) -> Centroids:
    """k-means on a sample of SAMPLE_PER_CLUSTER rows per centroid, drawn from whole parts read
    in random order. Clustered after subtracting the mean: every CLIP embedding shares a
    direction, and unshifted, a centroid near it is second-nearest to most rows (a hub every row
    visits). A shift keeps distances, so the bisector reach of `assign` still holds."""
    want = min(parts.num_rows, k * SAMPLE_PER_CLUSTER)
    sample, have = [], 0
    for i in rng.permutation(len(parts.readers)):
        _, emb = parts.readers[i]()
        sample.append(emb)
        have += len(emb)
        if have >= 2 * want:
            break
    sample = np.concatenate(sample)
    sample = unit(sample[rng.choice(len(sample), want, replace=False)], device or CPU)
    center = sample.mean(0)
    return Centroids(kmeans(sample - center, k, dtype, generator), center)


def fit_seeded(
    parts: Parts, k: int, dtype: torch.dtype, seed: int = 0, device: torch.device | None = None
) -> tuple[Centroids, np.random.Generator]:
    """`fit_centroids` from generators seeded with `seed`, as `SemanticIndex` fits them (the
    partitioned path fits with it too: the same centroids); and the numpy generator after the
    fit, which the index goes on to draw its risk sample from."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    return fit_centroids(parts, k, dtype, rng, generator, device), rng


def visitor_caps(primaries: np.ndarray, num_rows: int, num_clusters: int) -> np.ndarray:
    """The most visitors each cluster takes (those nearest its border): VISITOR_SHARE x its own
    rows (`primaries`) or the mean cluster's. A centroid in the middle of the cloud is in reach
    of a large share of all rows (a hub): comparing them all there is quadratic."""
    return VISITOR_SHARE * np.maximum(primaries, num_rows // num_clusters)


def assign(
    y: torch.Tensor, centroids: torch.Tensor, reach: float, max_visits: int, between=None
) -> tuple[torch.Tensor, ...]:
    """(nearest cluster [b], visited clusters or -1 [b, m], distance to their bisectors [b, m],
    at risk [b] or None) of rows `y` (unit, less the center). A row y of cluster B also visits
    the next-nearest centroids A whose cell lies within `reach` = sqrt(2 - 2 t) of it (its
    distance to the bisector of cA and cB): a duplicate x of y in A's cell would be that close,
    as the segment x-y crosses the bisector. `between` (centroid distances [k, k]) given, the
    rows with an unvisited centroid within reach are flagged at risk."""
    k = len(centroids)
    every = _scores(y, centroids, torch.float32)
    # topk breaks exact ties (equal centroids) by its k: the one past the visits,
    # which the layout was first drawn with, keeps it as it was.
    past = min(k, 2 + max_visits)
    scores, nearest = (t[:, : 1 + max_visits] for t in every.topk(past))
    # y's distance to the bisector of cA, cB: (|y-cA|^2 - |y-cB|^2) / 2|cA-cB|.
    apart = (centroids[nearest[:, 1:]] - centroids[nearest[:, :1]]).norm(dim=2)
    to_bisector = (scores[:, :1] - scores[:, 1:]) / apart.clamp_min(1e-6)
    visited = torch.where(to_bisector <= reach, nearest[:, 1:], -1)
    far = None
    if between is not None:
        far = _unvisited_in_reach(every, between[nearest[:, 0]], nearest[:, 0], visited, reach)
        far = far.any(1)
    return nearest[:, 0], visited, to_bisector, far


def _unvisited_in_reach(
    scores: torch.Tensor,
    apart: torch.Tensor,
    primary: torch.Tensor,
    visited: torch.Tensor,
    reach: float,
) -> torch.Tensor:
    """[b, k] bool: the centroids within reach of each row (bisector distance, as `assign`;
    `apart`: its own centroid's distance to each, overwritten) that are neither its own
    (`primary` [b]) nor one it visits (`visited` [b, m], -1: none)."""
    own = scores.gather(1, primary[:, None])
    near = own - scores <= apart.mul_(reach)
    mine = torch.cat([primary[:, None], torch.where(visited >= 0, visited, primary[:, None])], 1)
    return near.scatter_(1, mine, False)


@dataclass(frozen=True, slots=True)
class Missed:
    """Of `sampled` rows at risk (`SemanticIndex.beyond_visits`), `missed_sample` had a
    duplicate they were never compared with: ~`estimated` such rows in all."""

    sampled: int
    missed_sample: int
    estimated: int


class SemanticIndex:
    """Rows laid out by cluster, each cluster in rank order; `losers` applies the survivor rule
    (`tasks.curation.survivors`) to any subset of the rows, from the same layout."""

    def __init__(
        self,
        parts: Parts,
        rank: np.ndarray,
        threshold: float,
        *,
        device: str | torch.device | None = None,
        num_clusters: int | None = None,
        max_visits: int = 2,
        workdir: Path | None = None,
        seed: int = 0,
        miss_sample: int = MISS_SAMPLE,
        centroids: Centroids | None = None,
    ):
        """`centroids` given: these clusters (`num_clusters` is theirs), no k-means."""
        n = parts.num_rows
        self.parts, self.threshold = parts, threshold
        self.device = torch.device(device or "cpu")
        self.dtype, self.margin = screen(self.device)
        self.num_clusters = min(n, num_clusters or num_clusters_for(n)) or 1
        if centroids is not None:
            self.num_clusters = len(centroids.centroids)
        order = np.argsort(rank, kind="stable")
        dense_rank = np.empty(n, np.int64)
        dense_rank[order] = np.arange(n)
        self.max_visits = min(max_visits, self.num_clusters - 1)
        # Rows with a centroid within reach that they do not visit (past their `max_visits`
        # nearest, or cut by a cluster's visitor cap): only they can miss a duplicate, and
        # `estimate_missed` looks for misses in a seeded sample of them (`miss_sample` rows).
        self.beyond_visits = 0
        self.risk_sample = np.zeros(0, np.int64)
        self.centroids: torch.Tensor | None = None
        primary, visits = self._assign(seed, miss_sample, centroids)
        # Slots: one per (cluster, row) entry, ordered by cluster, then rank.
        visitor_row, visit = np.nonzero(visits >= 0)
        cluster = np.concatenate([primary, visits[visitor_row, visit]]).astype(np.int64)
        entry_rank = np.concatenate([dense_rank, dense_rank[visitor_row]])
        by_slot = np.argsort((cluster << 40) | entry_rank)  # entry of each slot
        self.slot_row = order[entry_rank[by_slot]]
        self.offsets = np.searchsorted(cluster[by_slot], np.arange(self.num_clusters + 1))
        self.slot_cluster = cluster[by_slot].astype(np.int32)
        slot_of_entry = np.empty_like(by_slot)
        slot_of_entry[by_slot] = np.arange(len(by_slot))
        self.primary_slot = slot_of_entry[:n]
        self.visitor_slot = np.full(visits.shape, -1, np.int64)
        self.visitor_slot[visitor_row, visit] = slot_of_entry[n:]
        self.num_visits = len(visitor_row)
        self.largest_cluster = int(np.diff(self.offsets).max()) if n else 0  # rows + visitors
        self.temp_bytes = 0  # the most bytes the store's folder held while it was built
        if workdir is None:
            self.store = np.empty((len(by_slot), parts.dim), np.float16)
            for read in parts.readers:
                rows, emb = read()
                self.store[self.primary_slot[rows]] = emb
                for slot in self.visitor_slot[rows].T:
                    self.store[slot[slot >= 0]] = emb[slot >= 0]
        else:  # on disk, written in sequence; the page cache holds what fits
            self.store, self.temp_bytes = cluster_ordered(
                parts, self.primary_slot, self.visitor_slot, self.offsets, workdir
            )
        self.rounds = 0
        self.alone: np.ndarray | None = None  # rows without a better duplicate among all

    def _unit(self, emb: np.ndarray) -> torch.Tensor:
        return unit(emb, self.device)

    def _assign(
        self, seed: int, miss_sample: int, given: Centroids | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(nearest cluster [N], visited clusters or -1 [N, max_visits]), as `assign` puts
        them. With every centroid in reach visited no pair is missed; `max_visits` caps them
        (SemDeDup visits none), and so does each cluster's `visitor_caps`."""
        n, k = self.parts.num_rows, self.num_clusters
        primary = np.zeros(n, np.int32)
        visits = np.full((n, self.max_visits), -1, np.int32)
        if k == 1:
            return primary, visits
        gap = np.full((n, self.max_visits), np.inf, np.float32)  # distance to the bisector
        if given is None:
            given, rng = fit_seeded(self.parts, k, self.dtype, seed, self.device)
        else:
            rng = np.random.default_rng(seed)
        centroids, center = given.centroids.to(self.device), given.center.to(self.device)
        self.centroids, self.center = centroids, center
        self.reach = reach = math.sqrt(max(0.0, 2 - 2 * self.threshold))
        between = torch.cdist(centroids, centroids)  # k x k: 4 N bytes, as k ~ sqrt(N)
        at_risk = np.zeros(n, bool)
        for read in self.parts.readers:
            rows, emb = read()
            for start in range(0, len(rows), ASSIGN_ROWS):
                y = self._unit(emb[start : start + ASSIGN_ROWS]) - center
                nearest, visited, to_bisector, far = assign(
                    y, centroids, reach, self.max_visits, between
                )
                chunk = rows[start : start + ASSIGN_ROWS]
                at_risk[chunk] = far.cpu().numpy()
                primary[chunk] = nearest.cpu().numpy()
                visits[chunk] = visited.cpu().numpy()
                gap[chunk] = to_bisector.cpu().numpy()
        # Each cluster takes the visitors nearest its border, up to its cap (ties: by row).
        row, visit = np.nonzero(visits >= 0)
        cluster = visits[row, visit].astype(np.int64)
        order = np.lexsort((gap[row, visit], cluster))
        cluster = cluster[order]
        place = np.arange(len(order)) - np.searchsorted(cluster, cluster)
        cap = visitor_caps(np.bincount(primary, minlength=k), n, k)
        cut = order[place >= cap[cluster]]
        visits[row[cut], visit[cut]] = -1
        at_risk[row[cut]] = True
        self.beyond_visits = int(at_risk.sum())
        risky = np.flatnonzero(at_risk)
        self.risk_sample = np.sort(rng.choice(risky, min(miss_sample, len(risky)), replace=False))
        return primary, visits

    def clusters_of(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), 1 + m]: each row's own cluster, then those it visits (-1: none)."""
        visited = np.where(self.visitor_slot[rows] >= 0, self.visitor_slot[rows], -1)
        slots = np.concatenate([self.primary_slot[rows, None], visited], axis=1)
        return np.where(slots >= 0, self.slot_cluster[slots], -1)

    def estimate_missed(self) -> Missed:
        """Duplicates the clusters missed, estimated: each row of `risk_sample` is compared with
        the rows of every cluster within its reach that it does not visit (reading each such
        cluster once), and counts if one is a duplicate (cosine >= threshold, float64) that
        shares no cluster with it, so was never compared. A miss of a pair, not of a decision:
        the row may still be dropped as the copy of another."""
        rows = self.risk_sample
        if not len(rows):
            return Missed(sampled=0, missed_sample=0, estimated=0)
        mine = self.clusters_of(rows)
        raw = torch.from_numpy(np.asarray(self.store[self.primary_slot[rows]])).to(self.device)
        y = F.normalize(raw.float(), dim=1) - self.center
        primary = torch.from_numpy(mine[:, 0].astype(np.int64)).to(self.device)
        visited = torch.from_numpy(mine[:, 1:].astype(np.int64)).to(self.device)
        apart = torch.cdist(self.centroids[primary], self.centroids)
        scores = _scores(y, self.centroids, torch.float32)
        far = _unvisited_in_reach(scores, apart, primary, visited, self.reach)
        query, cluster = (t.cpu().numpy() for t in far.nonzero(as_tuple=True))
        missed = np.zeros(len(rows), bool)
        for c in np.unique(cluster):
            start, stop = self.offsets[c], self.offsets[c + 1]
            q = query[cluster == c]
            members = torch.from_numpy(np.array(self.store[start:stop])).to(self.device)
            i, j = self._pairs(raw[torch.from_numpy(q).to(self.device)], members)
            q, x = q[i], self.slot_row[start + j]
            shared = (mine[q, :, None] == self.clusters_of(x)[:, None, :]) & (mine[q, :, None] >= 0)
            missed[q[~shared.any(axis=(1, 2))]] = True
        num_missed = int(missed.sum())
        return Missed(
            sampled=len(rows),
            missed_sample=num_missed,
            estimated=round(num_missed / len(rows) * self.beyond_visits),
        )

    def _pairs(self, raw_q: torch.Tensor, raw: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(i, j): the pairs of rows `raw_q[i]`, `raw[j]` (fp16) at cosine >= threshold, screened
        in low precision and confirmed in float64, a block of each at a time."""
        cut = self.threshold - self.margin
        low_q = F.normalize(raw_q.float(), dim=1).to(self.dtype)
        found_i, found_j = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]
        for r0 in range(0, len(raw), REF_BLOCK):
            ref = raw[r0 : r0 + REF_BLOCK]
            low_ref = F.normalize(ref.float(), dim=1).to(self.dtype)
            for q0 in range(0, len(raw_q), SAMPLE_BLOCK):
                near = (low_q[q0 : q0 + SAMPLE_BLOCK] @ low_ref.T).float() >= cut
                some_q, some_r = near.any(1).nonzero().flatten(), near.any(0).nonzero().flatten()
                if not len(some_q):
                    continue
                exact_q = F.normalize(raw_q[q0 + some_q].double(), dim=1)
                exact_r = F.normalize(ref[some_r].double(), dim=1)
                i, j = ((exact_q @ exact_r.T) >= self.threshold).nonzero(as_tuple=True)
                found_i.append((q0 + some_q[i]).cpu())
                found_j.append((r0 + some_r[j]).cpu())
        return torch.cat(found_i).numpy(), torch.cat(found_j).numpy()

    def losers(self, include: np.ndarray | None = None) -> np.ndarray:
        """Rows dropped by the survivor rule among `include` (default all), bool [N].

        The first round of a call over all rows compares every pair in every cluster; the rows
        it finds without a better duplicate have none in any subset either, so later calls
        (the rows earlier levels kept) start them as survivors and compare only the rest.
        """
        n = self.parts.num_rows
        state = np.full(n, UNDECIDED, np.int8)
        if include is not None:
            state[~np.asarray(include, bool)] = ABSENT
        if self.alone is not None:
            state[(state == UNDECIDED) & self.alone] = SURVIVES
        self.rounds = 0
        while True:
            waiting = state[self.slot_row] == UNDECIDED
            if not waiting.any():
                break
            has_survivor, has_undecided = np.zeros(n, bool), np.zeros(n, bool)
            for c in np.unique(self.slot_cluster[waiting]):
                self._scan(int(c), state, has_survivor, has_undecided)
            settle(state, has_survivor, has_undecided)
            if self.rounds == 0 and include is None and self.alone is None:
                self.alone = state == SURVIVES
            self.rounds += 1
        return state == DROPPED

    def _scan(
        self, c: int, state: np.ndarray, has_survivor: np.ndarray, has_undecided: np.ndarray
    ) -> None:
        """Flag cluster c's undecided rows that have a better-ranked duplicate there that
        survives / that is undecided. Rows are in rank order: the better ones come first.
        Visitors are compared with each other too: with visits capped, the cluster they both
        visit may be the only one where two rows near a boundary meet."""
        start, stop = self.offsets[c], self.offsets[c + 1]
        rows = self.slot_row[start:stop]
        to_survivor, to_undecided = flag_duplicates(
            self.store[start:stop],
            state[rows],
            self.threshold,
            self.margin,
            self.dtype,
            self.device,
        )
        has_survivor[rows[to_survivor]] = True
        has_undecided[rows[to_undecided]] = True


def flag_duplicates(
    store: np.ndarray,
    row_state: np.ndarray,
    threshold: float,
    margin: float,
    dtype: torch.dtype,
    device: torch.device,
    split: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(positions of the undecided rows of `store` (fp16 [n, D], rows in rank order; states
    `row_state` [n]) with a better-placed duplicate that survives, that is undecided). `split`
    given (a block pair of a split cluster: better block, then worse), queries are only at or
    past it and their duplicates only before it."""
    queries = np.flatnonzero(row_state == UNDECIDED)
    refs = np.flatnonzero(row_state <= SURVIVES)  # undecided or surviving
    if split is not None:
        queries, refs = queries[queries >= split], refs[refs < split]
    empty = np.zeros(0, np.int64)
    if not len(queries) or not len(refs) or refs[0] >= queries[-1]:
        return empty, empty
    raw = torch.from_numpy(np.array(store)).to(device)
    low = F.normalize(raw.float(), dim=1).to(dtype)
    survives = torch.from_numpy(row_state == SURVIVES).to(device)
    return _sweep(raw, low, survives, queries, refs, threshold, margin, device)


def _sweep(
    raw: torch.Tensor,
    low: torch.Tensor,
    survives: torch.Tensor,
    queries: np.ndarray,
    refs: np.ndarray,
    threshold: float,
    margin: float,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray]:
    """(queries with a better duplicate among `refs` that survives, that is undecided):
    positions in the cluster. A query stops at its first such duplicate (more would not
    change this round). Pairs are screened in low precision, confirmed in float64."""
    cut = threshold - margin
    to_survivor, to_undecided = [], []
    for q0 in range(0, len(queries), QUERY_BLOCK):
        active = torch.from_numpy(queries[q0 : q0 + QUERY_BLOCK]).to(device)
        better = refs[refs < queries[min(q0 + QUERY_BLOCK, len(queries)) - 1]]
        for r0 in range(0, len(better), REF_BLOCK):
            if not len(active):
                break
            ref = torch.from_numpy(better[r0 : r0 + REF_BLOCK]).to(device)
            before = ref[None, :] < active[:, None]
            near = ((low[active] @ low[ref].T).float() >= cut) & before
            some = near.any(1)
            if not some.any():
                continue
            q, cols = active[some], near[some].any(0)
            r = ref[cols]
            exact_q = F.normalize(raw[q].double(), dim=1)
            exact_r = F.normalize(raw[r].double(), dim=1)
            hit = ((exact_q @ exact_r.T) >= threshold) & before[some][:, cols]
            surviving = (hit & survives[r][None, :]).any(1)
            waiting = (hit & ~survives[r][None, :]).any(1)
            to_survivor.append(q[surviving].cpu().numpy())
            to_undecided.append(q[waiting].cpu().numpy())
            settled = torch.zeros(len(active), dtype=torch.bool, device=device)
            settled[some.nonzero().flatten()[surviving | waiting]] = True
            active = active[~settled]
    empty = np.zeros(0, np.int64)
    return np.concatenate([empty, *to_survivor]), np.concatenate([empty, *to_undecided])
