"""pHash near-duplicates: every pair within k bits, from sorted permuted prefixes, once.

The 64 bits are cut into B blocks; two hashes within k bits differ in at most k blocks, so
they agree on some B - k of them. One table per choice of those blocks sorts the distinct
hashes by them (a key of up to 32 bits) and compares only equal keys. B grows with the number
of hashes so keys stay long enough that chance collisions are a few per hash: the work is
tables x N log N plus the true pairs, where the k + 1 bands of pigeonhole grow as N^2 / 2^13.
"""

from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tasks.curation.survivors import dropped_nodes

KEY_BITS = 32  # a table's key shares one uint64 with the hash's index (< 2^32 distinct hashes)
MAX_EXTRA_BLOCKS = 8  # blocks beyond k + 1 that `plan` considers
# A candidate pair's check against one hash's share of a table's sort, measured on 10M hashes
# (2-core VM): a table cost ~99 ns per hash, 2.4e7 chance pairs added ~21 ns each.
PAIR_COST = 0.2


def cut(num_blocks: int) -> list[tuple[int, int]]:
    """(shift, width) of `num_blocks` blocks covering 64 bits, widths as equal as can be."""
    widths = [64 // num_blocks + (1 if i < 64 % num_blocks else 0) for i in range(num_blocks)]
    shifts = np.cumsum([0, *widths[:-1]]).tolist()
    return list(zip(shifts, widths, strict=True))


def plan(
    num_hashes: int, max_distance: int, num_blocks: int | None = None
) -> tuple[list[tuple[int, int]], list[tuple[int, ...]]]:
    """(blocks, tables) with the least modelled work: per table one sort of every hash plus
    the pairs its key puts together by chance (num_hashes / 2^(key bits + 1) per hash), each
    checked at PAIR_COST of a hash's share of the sort. `num_blocks` forces B."""
    k = max_distance
    options = []
    choices = [num_blocks] if num_blocks else range(k + 1, min(64, k + 1 + MAX_EXTRA_BLOCKS) + 1)
    for b in choices:
        if math.comb(b, k) > 2000 and options:
            break
        blocks = cut(b)
        tables = list(itertools.combinations(range(b), b - k))
        key_bits = [min(KEY_BITS, sum(blocks[i][1] for i in t)) for t in tables]
        cost = sum(1 + PAIR_COST * num_hashes / 2 ** (bits + 1) for bits in key_bits)
        options.append((cost, b, blocks, tables))
    _, _, blocks, tables = min(options)
    return blocks, tables


def first_table(blocks: list, tables: list) -> np.ndarray:
    """For each set of differing blocks (a bit mask), the first table whose blocks all agree."""
    masks = np.arange(1 << len(blocks))
    first = np.full(len(masks), -1, np.int32)
    for t in reversed(range(len(tables))):  # the earliest table written last
        first[(masks & sum(1 << i for i in tables[t])) == 0] = t
    return first


def table_key(
    hashes: np.ndarray, t: int, blocks: list, tables: list, packed: np.ndarray | None = None
) -> np.ndarray:
    """Table t's key of each hash (its blocks, concatenated, at most KEY_BITS) in the top 32
    bits of a uint64, OR-ed into `packed` (default zeros): equal keys, equal top bits."""
    room = KEY_BITS
    packed = np.zeros(len(hashes), np.uint64) if packed is None else packed
    part = np.empty_like(packed)
    for b in tables[t]:
        shift, width = blocks[b]
        used = min(width, room)  # the block's top `used` bits
        if used <= 0:
            break
        room -= used
        np.right_shift(hashes, np.uint64(shift + width - used), out=part)
        np.bitwise_and(part, np.uint64(2**used - 1), out=part)
        np.left_shift(part, np.uint64(32 + room), out=part)
        np.bitwise_or(packed, part, out=packed)
    return packed


def table_pairs(
    distinct: np.ndarray, t: int, blocks: list, tables: list, k: int, first: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (a < b, indices into `distinct`) within k bits whose first agreeing table is t."""
    # Key above the index, in one uint64: a plain sort (no argsort) groups equal keys, indices
    # ascending within a key.
    packed = table_key(distinct, t, blocks, tables, np.arange(len(distinct), dtype=np.uint64))
    packed.sort()
    part = np.empty_like(packed)
    low = np.uint64(0xFFFFFFFF)
    index = packed & low
    np.bitwise_xor(packed[1:], packed[:-1], out=part[:-1])
    # Positions i whose key equals the key at i + j, for j = 1, 2, ...: each set is a subset of
    # the last, so the work is the pairs inside runs of equal keys, not a pass per j.
    at = np.flatnonzero(part[:-1] <= low)
    del part
    hashes = distinct[index]  # in table order: the candidates below read it near-sequentially
    found_a, found_b = [], []
    j = 1
    while at.size:
        x = hashes[at] ^ hashes[at + j]
        close = np.bitwise_count(x) <= k
        if close.any():
            pos, x = at[close], x[close]
            differs = np.zeros(len(x), np.int64)
            for i, (shift, width) in enumerate(blocks):
                piece = (x >> np.uint64(shift)) & np.uint64(2**width - 1)
                differs |= (piece != 0).astype(np.int64) << i
            pos = pos[first[differs] == t]  # else an earlier table finds the pair
            found_a.append(index[pos].astype(np.int64))
            found_b.append(index[pos + j].astype(np.int64))
        j += 1
        at = at[at + j < len(packed)]
        at = at[(packed[at + j] ^ packed[at]) <= low]
    if not found_a:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(found_a), np.concatenate(found_b)


def near_pairs(
    distinct: np.ndarray,
    max_distance: int,
    threads: int | None = None,
    num_blocks: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of `distinct` (unique uint64) within `max_distance` bits, once: (a, b) int64
    indices, a < b. `num_blocks` forces the plan (tests: the plans of larger inputs)."""
    if max_distance <= 0 or len(distinct) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if len(distinct) >= 2**32:
        raise ValueError(f"{len(distinct)} distinct hashes: at most 2^32 are supported")
    blocks, tables = plan(len(distinct), max_distance, num_blocks)
    first = first_table(blocks, tables)

    def one(t: int) -> tuple[np.ndarray, np.ndarray]:
        return table_pairs(distinct, t, blocks, tables, max_distance, first)

    # numpy's sorts and element-wise loops release the GIL: tables run side by side.
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        found = list(pool.map(one, range(len(tables))))
    return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])


class NearHashes:
    """The near pairs of a set of row hashes, found once; `losers` applies the survivor rule
    to any subset of the rows (the alone and the in-sequence counts share the pairs)."""

    def __init__(self, hashes: np.ndarray, max_distance: int, threads: int | None = None):
        self.distinct, self.node = np.unique(np.asarray(hashes, np.uint64), return_inverse=True)
        self.a, self.b = near_pairs(self.distinct, max_distance, threads)

    @property
    def num_pairs(self) -> int:
        return len(self.a)

    def losers(self, rank: np.ndarray, include: np.ndarray | None = None) -> np.ndarray:
        """Rows dropped by the survivor rule among `include` (default all), bool [N].

        `rank` int64 [N], unique, lower is better. Rows with one hash are one node ranked by its
        best row; the other rows are its copies (dropped whether it survives or not: a row that
        drops it is within the distance of them too).
        """
        rank = np.asarray(rank, np.int64)
        include = np.ones(len(rank), bool) if include is None else np.asarray(include, bool)
        never = np.iinfo(np.int64).max
        best = np.full(len(self.distinct), never, np.int64)
        np.minimum.at(best, self.node[include], rank[include])
        lost_node = np.zeros(len(self.distinct), bool)
        if self.num_pairs:
            # Only the nodes in some pair can be dropped as another's copy: settle those alone.
            in_pair = np.zeros(len(self.distinct), bool)
            in_pair[self.a] = in_pair[self.b] = True
            nodes = np.flatnonzero(in_pair)
            local = np.cumsum(in_pair) - 1
            a, b = local[self.a], local[self.b]
            best_local = best[nodes]
            swap = best_local[a] > best_local[b]
            better, worse = np.where(swap, b, a), np.where(swap, a, b)
            lost_node[nodes] = dropped_nodes(best_local < never, better, worse)
        return include & (lost_node[self.node] | (rank != best[self.node]))
