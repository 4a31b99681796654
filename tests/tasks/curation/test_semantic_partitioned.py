"""Partitioned semantic dedup decides exactly as the one-node path (`SemanticIndex`) at the same
centroids on awkward inputs: clusters split into blocks, ties in rank, rows with no embedding,
an empty cluster and an empty file, rows over several ranges and worker processes; and a task
killed mid-round is rerun alone, its half-written folder removed, the rest reused. As
filter-pixels' hook (`PartitionedSemantic`), it marks what the one-node level marks."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from catalog.schema import FilterProfile
from tasks.curation import dedup, semantic_dedup
from tasks.curation import semantic_partitioned as sp
from tasks.curation.partition_files import LocalProcesses, peak_rss_gb
from tasks.curation.semantic_dedup import Centroids, Parts, SemanticIndex
from tests.tasks.curation.test_dedup import greedy_over_all_pairs
from tests.tasks.curation.test_semantic_dedup import THRESHOLD, all_pairs, planted

ROWS_PER_FILE = 400


def centroids_for(x: np.ndarray, k: int, seed: int = 0) -> Centroids:
    """k-means on a sample, as the one-node path fits it (whole parts, seeded)."""
    parts = Parts.from_array(x, part_rows=ROWS_PER_FILE)
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    return semantic_dedup.fit_centroids(parts, k, torch.float32, rng, generator)


def one_node(x, rank, centroids, max_visits=2) -> np.ndarray:
    parts = Parts.from_array(x, part_rows=ROWS_PER_FILE)
    index = SemanticIndex(parts, rank, THRESHOLD, centroids=centroids, max_visits=max_visits)
    return index.losers()


def partitioned(tmp_path, x, rank, centroids, *, max_visits=2, executor=None, **settings):
    paths = sp.write_inputs(tmp_path / "in", x, rank, ROWS_PER_FILE)
    plan = sp.make_plan(
        paths, len(x), THRESHOLD, centroids, tmp_path / "work", max_visits=max_visits, **settings
    )
    run = sp.run_semantic(plan, executor)
    return run.dropped(), run


@pytest.mark.parametrize(("k", "max_visits"), [(12, 2), (12, 11), (1, 2)])
def test_planted_duplicates_decide_as_one_node_over_row_ranges(tmp_path, k, max_visits):
    x = planted(3000)
    rank = np.random.default_rng(1).permutation(3000)
    centroids = centroids_for(x, k)
    expected = one_node(x, rank, centroids, max_visits)
    lost, run = partitioned(tmp_path, x, rank, centroids, max_visits=max_visits, rows_per_range=700)
    np.testing.assert_array_equal(lost, expected)
    assert expected.sum() > 250 and run.plan.num_parts == 5 and run.rounds >= 2
    if max_visits == 11:  # every cluster in reach visited: all pairs' decisions
        np.testing.assert_array_equal(lost, greedy_over_all_pairs(all_pairs(x), rank))


def test_clusters_over_the_task_size_are_split_into_block_pairs(tmp_path):
    x = planted(1600, seed=2)
    rank = np.random.default_rng(3).permutation(1600)
    centroids = centroids_for(x, 3)
    lost, run = partitioned(tmp_path, x, rank, centroids, slots_per_task=300)
    np.testing.assert_array_equal(lost, one_node(x, rank, centroids))
    blocks = [p for p in sp.pieces(run.plan) if p[2] >= 0]
    assert max(p[2] for p in blocks) >= 3 and any(p[2] != p[3] for p in blocks)


def test_ties_in_rank_are_broken_by_row_as_one_node(tmp_path):
    x = planted(2000, seed=4)
    rank = np.random.default_rng(5).integers(0, 40, 2000)  # ~50 rows share each rank
    centroids = centroids_for(x, 8)
    lost, _ = partitioned(tmp_path, x, rank, centroids, rows_per_range=500)
    expected = one_node(x, rank, centroids)
    np.testing.assert_array_equal(lost, expected)
    assert expected.sum() > 100


def test_rows_with_no_embedding_are_left_out_and_counted(tmp_path):
    x = planted(2000, seed=6).astype(np.float32)
    rng = np.random.default_rng(7)
    rank = rng.permutation(2000)
    none = rng.random(2000) < 0.1
    x[none & (rng.random(2000) < 0.5)] = np.nan
    x[none & ~np.isnan(x[:, 0])] = 0
    has = ~none
    centroids = centroids_for(x[has].astype(np.float16), 8)
    lost, run = partitioned(tmp_path, x.astype(np.float16), rank, centroids)
    # One node over the rows with an embedding (`dedup.mark` gives it only those).
    expected = np.zeros(2000, bool)
    index = SemanticIndex(
        Parts.from_array(x[has].astype(np.float16)), rank[has], THRESHOLD, centroids=centroids
    )
    expected[has] = index.losers()
    np.testing.assert_array_equal(lost, expected)
    maps = [r for r in run.records if r["task"].startswith("map")]
    assert sum(r["no_embedding"] for r in maps) == none.sum() and not lost[none].any()


def test_an_empty_cluster_and_an_empty_file(tmp_path):
    x = planted(1200, seed=8)
    rank = np.random.default_rng(9).permutation(1200)
    fitted = centroids_for(x, 6)
    far = 10 * torch.nn.functional.normalize(torch.ones(1, x.shape[1]), dim=1)  # no row's
    centroids = Centroids(
        torch.cat([fitted.centroids[:3], far, fitted.centroids[3:]]), fitted.center
    )
    paths = sp.write_inputs(tmp_path / "in", x, rank, ROWS_PER_FILE)
    paths += sp.write_inputs(tmp_path / "empty", x[:0], rank[:0], 1) or []
    np.save(tmp_path / "none.npy", np.zeros(0, sp.input_dtype(x.shape[1])))
    plan = sp.make_plan([*paths, tmp_path / "none.npy"], 1200, THRESHOLD, centroids, tmp_path)
    run = sp.run_semantic(plan)
    counts = sum(np.diff(np.load(f / "slots.offsets.npy")) for f in plan.maps())
    assert counts[3] == 0 and plan.num_clusters == 7
    np.testing.assert_array_equal(run.dropped(), one_node(x, rank, centroids))


def test_a_task_killed_mid_round_is_rerun_alone(tmp_path, monkeypatch):
    x = planted(2000, seed=10)
    rank = np.random.default_rng(11).permutation(2000)
    centroids = centroids_for(x, 8)
    paths = sp.write_inputs(tmp_path / "in", x, rank, ROWS_PER_FILE)
    plan = sp.make_plan(paths, 2000, THRESHOLD, centroids, tmp_path / "w", slots_per_task=300)
    calls = []
    scan = sp._scan

    def dies_in_round_two(tmp, p, r, *args):
        calls.append(r)
        if r == 2:
            (tmp / "slots.emb.npy").write_bytes(b"\x93NUMPY partial")
            raise RuntimeError("killed")
        return scan(tmp, p, r, *args)

    monkeypatch.setattr(sp, "_scan", dies_in_round_two)
    with pytest.raises(RuntimeError, match="killed"):
        sp.run_semantic(plan)
    monkeypatch.setattr(sp, "_scan", scan)
    run = sp.run_semantic(plan)
    np.testing.assert_array_equal(run.dropped(), one_node(x, rank, centroids))
    by_stage = {}
    for r in run.records:
        by_stage.setdefault(r["task"].split("/")[0], []).append(r)
    # The maps and round one are reused; round two starts again, its half-written folder gone.
    assert all(r["reused"] for r in by_stage["map"]) and run.rounds >= 2
    rerun = [r for r in by_stage["scans"] if r["task"].startswith("scans/00002/")]
    assert sum(r["stale_removed"] for r in rerun) == 1
    assert not any(r["task"].startswith("scans/00001/") for r in by_stage["scans"])
    assert not list(plan.root.rglob("*.tmp-*"))


def test_tasks_in_worker_processes_decide_as_in_one(tmp_path):
    x = planted(1200, seed=12)
    rank = np.random.default_rng(13).permutation(1200)
    centroids = centroids_for(x, 4)
    with LocalProcesses(2) as workers:
        lost, run = partitioned(tmp_path, x, rank, centroids, slots_per_task=300, executor=workers)
    assert len({r["pid"] for r in run.records}) == 2
    np.testing.assert_array_equal(lost, one_node(x, rank, centroids))


def test_a_bad_input_file_names_itself(tmp_path):
    centroids = centroids_for(planted(500), 2)
    np.save(tmp_path / "bad.npy", np.zeros(3, np.uint64))
    with pytest.raises(ValueError, match="bad.npy"):
        sp.make_plan([tmp_path / "bad.npy"], 3, THRESHOLD, centroids, tmp_path)
    paths = sp.write_inputs(tmp_path / "in", planted(500)[:10], np.arange(10), 10)
    plan = sp.make_plan(paths, 5, THRESHOLD, centroids, tmp_path / "w")
    with pytest.raises(ValueError, match="00000.npy: a row id outside"):
        sp.run_semantic(plan)


def _peak(_: int) -> float:
    return peak_rss_gb()


def test_a_workers_peak_memory_is_its_own_not_its_parents():
    held = np.ones(2**27)  # 1 GiB in this process when the worker starts
    with LocalProcesses(1) as workers:
        (worker,) = workers.map(_peak, [(0,)])
    assert held.sum() and worker < peak_rss_gb() - 0.8  # it imports what this test module does


MARK_ROWS = 5000  # past semantic_dedup.SMALL: k-means clusters, fitted on a sample
SHARD_ROWS = 1700


def score_shards(folder: Path, x: np.ndarray) -> np.ndarray:
    """`x` as the score stage's shards (key, embedding) of SHARD_ROWS rows; the keys."""
    folder.mkdir()
    keys = np.array([f"k{i:05d}" for i in range(len(x))])
    for f, start in enumerate(range(0, len(x), SHARD_ROWS)):
        part = x[start : start + SHARD_ROWS]
        emb = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), x.shape[1])
        table = pa.table({"key": keys[start : start + SHARD_ROWS], "embedding": emb})
        pq.write_table(table, folder / f"{f:05d}.parquet")
    return keys


def marked(scores: Path, keys, aesthetic, earlier, semantic=None) -> tuple:
    """((alone, removed), the keys marked, notes) of `dedup.mark`'s semantic level over rows
    that an earlier level partly dropped (`earlier`)."""
    con = duckdb.connect()
    reason = pa.array(np.where(earlier, "duplicate_phash", None).tolist(), pa.string())
    con.register("k", pa.table({"key": keys, "aesthetic": aesthetic, "reason": reason}))
    con.sql("CREATE TABLE passing AS SELECT * FROM k")
    profile = FilterProfile(name="p", dedup=("semantic",), semantic_threshold=THRESHOLD)
    notes: dict = {}
    counts = dedup.mark(con, profile, "semantic", scores, notes=notes, semantic=semantic)
    lost = con.sql("SELECT key FROM passing WHERE reason = 'duplicate_semantic'").fetchall()
    return counts, sorted(k for (k,) in lost), notes


def test_the_hook_marks_as_the_one_node_level_over_all_rows_and_the_kept(tmp_path, monkeypatch):
    """filter-pixels' semantic level through `dedup.mark(semantic=PartitionedSemantic)`: the
    same alone and removed counts and the same rows marked as the one-node `SemanticIndex` (its
    centroids fitted from the score shards the same way; the kept rows' run lays out every
    row, the others absent); a second hook over the same rows reuses every task."""
    monkeypatch.setattr(sp, "ROWS_PER_RANGE", 1500)
    rng = np.random.default_rng(14)
    x = planted(MARK_ROWS, seed=14)
    keys = score_shards(tmp_path / "scores", x)
    aesthetic, earlier = rng.random(MARK_ROWS), rng.random(MARK_ROWS) < 0.3
    expected = marked(tmp_path / "scores", keys, aesthetic, earlier)
    hook = sp.PartitionedSemantic(LocalProcesses(0), tmp_path / "work", rows=700)
    got = marked(tmp_path / "scores", keys, aesthetic, earlier, semantic=hook)
    assert got[:2] == expected[:2]
    (alone, removed), lost = expected[:2]
    assert alone > removed > 100 and len(lost) == removed
    summary = got[2]["partitioned"]["semantic"]
    k = semantic_dedup.num_clusters_for(MARK_ROWS)
    assert summary["runs"] == 2 and summary["clusters"] == [k, k]
    assert summary["partitions"] == [4, 4] and min(summary["rounds"]) >= 2
    assert got[2]["semantic_visits"] == expected[2]["semantic_visits"]
    assert "semantic_missed_estimate" not in got[2]  # the one-node path's alone

    again = sp.PartitionedSemantic(LocalProcesses(0), tmp_path / "work", rows=700)
    assert marked(tmp_path / "scores", keys, aesthetic, earlier, semantic=again)[:2] == got[:2]
    assert again.summary()["reused"] == again.summary()["tasks"]
    hook.cleanup()
    assert not list((tmp_path / "work").iterdir())  # partition files, inputs and absent lists
