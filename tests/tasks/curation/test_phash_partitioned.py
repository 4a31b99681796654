"""Partitioned pHash dedup decides exactly as the one-node path (`dedup.phash_losers`,
`NearHashes.losers`) on awkward inputs: hot hashes, chains a~b~c with a !~ c, copies spread over
files, rows with no pHash, empty partitions; and a killed task is rerun alone, its half-written
folder removed and every finished partition reused."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from catalog import FilterProfile
from tasks.curation import dedup, phash_dedup
from tasks.curation import phash_partitioned as pp
from tasks.curation.partition_files import LocalProcesses


def partitioned(tmp_path, hashes, rank, k, *, rows_per_task=64, rows_per_file=50, num_ranks=None):
    """Rows dropped by the partitioned path, bool [len(hashes)], and its run."""
    paths = pp.write_inputs(tmp_path / "in", hashes, rank, rows_per_file)
    num_ranks = len(hashes) if num_ranks is None else num_ranks
    plan = pp.make_plan(paths, num_ranks, k, tmp_path / "work", rows_per_task=rows_per_task)
    run = pp.run_phash(plan)
    return run.dropped()[rank], run


def dense(rng: np.random.Generator, n: int, bits: int = 10) -> np.ndarray:
    """Hashes in a small space (dense near graphs: long chains, many rounds), scattered over
    the 64 bits so every block and table sees them, plus one hot hash."""
    spots = np.sort(rng.choice(64, bits, replace=False)).astype(np.uint64)
    low = rng.integers(0, 2**bits, n, dtype=np.uint64)
    hashes = np.zeros(n, np.uint64)
    for i, spot in enumerate(spots):
        hashes |= ((low >> np.uint64(i)) & np.uint64(1)) << spot
    hashes[rng.random(n) < 0.2] = hashes[0]  # one hash held by a fifth of the rows
    return hashes


@pytest.mark.parametrize(("seed", "k"), [(0, 1), (1, 4), (2, 4)])
def test_dense_hashes_and_a_hot_hash_decide_as_one_node(tmp_path, seed, k):
    rng = np.random.default_rng(seed)
    hashes = dense(rng, 1500)
    rank = rng.permutation(len(hashes))
    lost, run = partitioned(tmp_path, hashes, rank, k, rows_per_task=300, rows_per_file=200)
    assert (lost == dedup.phash_losers(hashes, rank, k)).all()
    assert run.plan.num_parts == 5 and run.rounds >= 2


def test_uniform_hashes_with_planted_copies_decide_as_one_node(tmp_path):
    rng = np.random.default_rng(5)
    hashes = rng.integers(0, 2**64, 3000, dtype=np.uint64)
    copies = rng.choice(3000, 600, replace=False)
    flips = rng.integers(0, 64, (600, 4)).astype(np.uint64)
    masks = np.bitwise_or.reduce(np.uint64(1) << flips, axis=1)
    hashes[copies] = hashes[rng.integers(0, 3000, 600)] ^ masks
    rank = rng.permutation(3000)
    lost, _ = partitioned(tmp_path, hashes, rank, 4, rows_per_task=500, rows_per_file=700)
    expected = dedup.phash_losers(hashes, rank, 4)
    assert expected.sum() > 300 and (lost == expected).all()


def test_a_chain_keeps_both_ends(tmp_path):
    # a~b (4 bits), b~c (4 bits), a !~ c (8 bits): a drops b, so c survives.
    hashes = np.array([0, 0xF, 0xFF, 0xF], np.uint64)
    lost, _ = partitioned(tmp_path, hashes, np.arange(4), 4, rows_per_task=1, rows_per_file=1)
    assert lost.tolist() == [False, True, False, True]


def test_an_alternating_chain_across_ranges_settles_in_rounds(tmp_path):
    # Each hash is 2 bits from the next and 4 from the one after (k = 3): a path. Ranks rise
    # along it, so each link waits for the one before, over every rank range.
    steps = np.arange(0, 60, 2, dtype=np.uint64)
    hashes = np.cumsum(np.uint64(3) << steps).astype(np.uint64)
    hashes = np.concatenate([np.zeros(1, np.uint64), hashes])
    rank = np.arange(31)
    lost, run = partitioned(tmp_path, hashes, rank, 3, rows_per_task=4, rows_per_file=3)
    assert (lost == dedup.phash_losers(hashes, rank, 3)).all()
    assert lost.tolist() == [i % 2 == 1 for i in range(31)] and run.rounds >= 10


def test_copies_of_one_hash_over_many_files_keep_the_best_and_are_split(tmp_path):
    rng = np.random.default_rng(3)
    hashes = np.where(rng.random(4000) < 0.5, np.uint64(7), rng.integers(0, 2**64, 4000, np.uint64))
    rank = rng.permutation(4000)  # the best copy lies in some file in the middle
    lost, run = partitioned(tmp_path, hashes, rank, 4, rows_per_task=400, rows_per_file=400)
    assert (lost == dedup.phash_losers(hashes, rank, 4)).all()
    # The hot hash reaches its bucket's task as one record per input file, not 2,000 rows.
    nodes = [r for r in run.records if r["task"].startswith("nodes")]
    assert max(r["rows"] for r in nodes) < 400


def test_rows_with_no_phash_and_excluded_rows_are_left_out(tmp_path):
    rng = np.random.default_rng(4)
    hashes = dense(rng, 800)
    rank = rng.permutation(800)
    given = rng.random(800) < 0.7  # the others: no pHash, or no longer kept
    lost, _ = partitioned(tmp_path, hashes[given], rank[given], 4, num_ranks=800)
    # One node, `NearHashes.losers` over the kept subset (`dedup.mark`'s in-sequence count).
    expected = phash_dedup.NearHashes(hashes, 4).losers(rank, given)
    assert (lost == expected[given]).all() and expected[~given].sum() == 0


def test_empty_inputs_and_empty_partitions(tmp_path):
    hashes = np.array([5, 5, 4], np.uint64)
    # Ranks far apart: most rank ranges hold no row; one input file holds none.
    rank = np.array([9000, 10, 4000])
    paths = pp.write_inputs(tmp_path / "in", hashes, rank, 2)
    paths += pp.write_inputs(tmp_path / "empty", hashes[:0], rank[:0], 1) or []
    np.save(tmp_path / "none.npy", np.zeros(0, pp.ROW))
    plan = pp.make_plan([*paths, tmp_path / "none.npy"], 10_000, 2, tmp_path / "w", rows_per_task=1)
    dropped = pp.run_phash(plan).dropped()
    assert np.flatnonzero(dropped).tolist() == [4000, 9000]
    nothing = pp.make_plan([tmp_path / "none.npy"], 0, 2, tmp_path / "w")
    assert pp.run_phash(nothing).dropped().size == 0


def test_a_killed_task_is_rerun_alone_and_finished_partitions_are_reused(tmp_path):
    rng = np.random.default_rng(6)
    hashes = dense(rng, 600)
    rank = rng.permutation(600)
    paths = pp.write_inputs(tmp_path / "in", hashes, rank, 100)
    plan = pp.make_plan(paths, 600, 4, tmp_path / "work", rows_per_task=100)
    for i in range(len(paths)):
        pp.scatter_task(plan, i)
    # A nodes task killed mid-write leaves its temporary folder with a partial file.
    half = plan.folder("nodes", 2).with_name("00002.tmp-host-12345")
    half.mkdir(parents=True)
    (half / "nodes.npy").write_bytes(b"\x93NUMPY partial")
    record = pp.nodes_task(plan, 2)
    assert record["stale_removed"] == 1 and not half.exists() and not record["reused"]
    run = pp.run_phash(plan)
    by_stage = {}
    for r in run.records:
        by_stage.setdefault(r["task"].split("/")[0], []).append(r["reused"])
    assert all(by_stage["scatter"]) and by_stage["nodes"].count(False) == 5
    assert (run.dropped()[rank] == dedup.phash_losers(hashes, rank, 4)).all()
    # Run again: every task reused, the rounds resumed from their progress, same answer.
    again = pp.run_phash(plan)
    assert all(r["reused"] for r in again.records)
    assert (again.dropped() == run.dropped()).all()


def test_a_bad_input_file_names_itself(tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros(3, np.uint64))
    with pytest.raises(ValueError, match="bad.npy"):
        pp.make_plan([tmp_path / "bad.npy"], 3, 4, tmp_path)
    pp.write_inputs(tmp_path / "in", np.zeros(2, np.uint64), np.array([0, 5]), 2)
    plan = pp.make_plan([tmp_path / "in" / "00000.npy"], 2, 4, tmp_path / "w")
    with pytest.raises(ValueError, match="00000.npy: a rank outside"):
        pp.run_phash(plan)


def test_tasks_in_worker_processes_decide_as_in_one(tmp_path):
    rng = np.random.default_rng(8)
    hashes = dense(rng, 1000)
    rank = rng.permutation(1000)
    paths = pp.write_inputs(tmp_path / "in", hashes, rank, 250)
    plan = pp.make_plan(paths, 1000, 4, tmp_path / "work", rows_per_task=250)
    with LocalProcesses(2) as workers:
        run = pp.run_phash(plan, workers)
    assert len({r["pid"] for r in run.records}) == 2
    assert (run.dropped()[rank] == dedup.phash_losers(hashes, rank, 4)).all()


def _hook_rows(tmp_path, seed: int):
    """700 dense hashes, their ranks, an included 60%, `NearHashes` over them (k = 3), and a
    hook with input files of 128 rows."""
    rng = np.random.default_rng(seed)
    hashes = dense(rng, 700)
    rank = rng.permutation(len(hashes))
    include = rng.random(len(hashes)) < 0.6
    losers = pp.PartitionedLosers(LocalProcesses(0), tmp_path / "work", rows=128)
    return hashes, rank, include, phash_dedup.NearHashes(hashes, 3), losers


def test_partitioned_losers_decide_as_near_hashes_over_all_and_over_the_included(tmp_path):
    """The hook filter-pixels' pHash level takes (`dedup.mark(phash=)`): losers among all rows,
    and among an included subset, as `NearHashes.losers(rank, include)`; a second hook over the
    same rows reuses every partition."""
    hashes, rank, include, near, losers = _hook_rows(tmp_path, 5)
    assert np.array_equal(losers(hashes, rank, 3, None), near.losers(rank))
    assert np.array_equal(losers(hashes, rank, 3, include), near.losers(rank, include))
    summary = losers.summary()
    assert summary["runs"] == 2 and summary["partitions"][0] == 6 and summary["reused"] == 0

    again = pp.PartitionedLosers(LocalProcesses(0), tmp_path / "work", rows=128)
    assert np.array_equal(again(hashes, rank, 3, include), near.losers(rank, include))
    assert again.summary()["reused"] == again.summary()["tasks"]
    losers.cleanup()
    assert not list((tmp_path / "work").iterdir())  # partition files and inputs alike


def _batches(hashes: np.ndarray, rank: np.ndarray, rows: int):
    """(hash, rank) in rank order as record batches of `rows`, as DuckDB hands them out."""
    order = np.argsort(rank)
    table = pa.table({"hash": hashes[order], "rank": rank[order].astype(np.int64)})
    return iter(table.to_batches(max_chunksize=rows))


def test_rows_given_as_batches_lose_as_near_hashes_and_a_rerun_reuses_everything(tmp_path):
    """`from_rows`: the hook filter-pixels' pHash level streams its rows to, in batches that
    do not line up with the input files (50 rows against files of 128)."""
    hashes, rank, include, near, losers = _hook_rows(tmp_path, 6)
    lost_all = np.concatenate(list(losers.from_rows(_batches(hashes, rank, 50), 700, 3)))
    assert np.array_equal(lost_all, np.sort(rank[near.losers(rank)]))  # ranks, ascending
    kept = _batches(hashes[include], rank[include], 50)
    lost_kept = np.concatenate(list(losers.from_rows(kept, 700, 3)))
    assert np.array_equal(np.sort(lost_kept), np.sort(rank[near.losers(rank, include)]))
    assert losers.summary()["runs"] == 2

    again = pp.PartitionedLosers(LocalProcesses(0), tmp_path / "work", rows=128)
    kept = _batches(hashes[include], rank[include], 70)  # other batches, same rows
    assert np.array_equal(np.concatenate(list(again.from_rows(kept, 700, 3))), lost_kept)
    assert again.summary()["reused"] == again.summary()["tasks"]
    assert list(again.from_rows(iter([]), 700, 3)) == []  # no rows: nothing lost, no run
    losers.cleanup()
    again.cleanup()
    assert not list((tmp_path / "work").iterdir())


def test_the_level_streams_its_rows_to_the_hook_and_marks_as_in_process(tmp_path):
    """`dedup.mark` with the partitioned hook marks the rows the in-process level marks, and
    hands it no array of every row (its array entry point is never called)."""
    rng = np.random.default_rng(7)
    n = 900
    hashes = dense(rng, n)
    table = pa.table(
        {
            "key": [f"{i:09d}" for i in range(n)],
            "phash": pa.array(hashes, pa.uint64()),
            "width": rng.integers(100, 400, n),
            "height": rng.integers(100, 400, n),
            "aesthetic": rng.normal(6, 1, n),
            "reason": pa.array(
                [None if rng.random() < 0.8 else "too_small" for _ in range(n)], pa.string()
            ),
        }
    )
    profile = FilterProfile(name="t", dedup=("phash",), phash_distance=3)

    class RowsOnly(pp.PartitionedLosers):
        def __call__(self, *args):
            raise AssertionError("every row's arrays handed over")

    marked = []
    for hook in (None, RowsOnly(LocalProcesses(0), tmp_path / "work", rows=128)):
        con = duckdb.connect()
        con.register("t", table)
        con.sql("CREATE TABLE passing AS SELECT * FROM t")
        counts = dedup.mark(con, profile, "phash", None, phash=hook)
        reasons = con.sql("SELECT key, reason FROM passing ORDER BY key").fetchall()
        marked.append((counts, reasons))
    assert marked[0] == marked[1]
    assert marked[0][0][1] > 0  # the level removed rows
