"""The survivor rule of near and semantic duplicates: greedy by rank, settled in rounds.

Rows are taken best rank first; a row survives unless a duplicate of it already survived.
So a row is dropped only as a copy of a survivor (never of a row that was itself dropped), no
two survivors are duplicates, and each group (a survivor and the rows dropped as its copies)
keeps one row. It is not connected components: a chain a~b~c with a !~ c keeps a and c.
"""

from __future__ import annotations

import numpy as np

UNDECIDED, SURVIVES, DROPPED, ABSENT = 0, 1, 2, 3


def settle(state: np.ndarray, has_survivor: np.ndarray, has_undecided: np.ndarray) -> int:
    """One round over every undecided row at once, from what its better-ranked duplicates were
    at the round's start: one of them survives -> dropped; all were dropped -> survives; else
    it waits. The best-ranked undecided row always settles, so rounds end. Returns how many
    settled."""
    undecided = state == UNDECIDED
    dropped = undecided & has_survivor
    survives = undecided & ~has_survivor & ~has_undecided
    state[dropped] = DROPPED
    state[survives] = SURVIVES
    return int(dropped.sum() + survives.sum())


def dropped_nodes(present: np.ndarray, better: np.ndarray, worse: np.ndarray) -> np.ndarray:
    """The rule over an explicit duplicate list: pair i says `better[i]` outranks its duplicate
    `worse[i]` (node indices). `present` bool [num_nodes]: nodes taking part; pairs touching an
    absent node are ignored. Returns bool [num_nodes]: dropped.

    Work per round is the pairs still open (both ends present, the worse one undecided); a
    clique settles in two rounds, a chain of alternating ranks in one round per link.
    """
    state = np.where(present, UNDECIDED, ABSENT).astype(np.int8)
    open_ = present[better] & present[worse]
    better, worse = better[open_], worse[open_]
    while better.size:
        has_survivor = np.zeros(len(state), bool)
        has_undecided = np.zeros(len(state), bool)
        from_state = state[better]
        has_survivor[worse[from_state == SURVIVES]] = True
        has_undecided[worse[from_state == UNDECIDED]] = True
        settle(state, has_survivor, has_undecided)
        # A pair matters while its worse end is undecided and its better end is not dropped.
        still = (state[worse] == UNDECIDED) & (state[better] != DROPPED)
        better, worse = better[still], worse[still]
    return state == DROPPED
