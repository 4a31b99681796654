"""Semantic dedup by clusters (SemDeDup) makes the decisions of the survivor rule over all
pairs on planted duplicates: copies, chains of copies and a blob of near-identical rows; its
low-precision screen never decides a pair; embeddings stream from the score shards."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from catalog.schema import FilterProfile
from tasks.curation import dedup, filter_pixels, semantic_dedup, semantic_store
from tasks.curation.semantic_dedup import Missed, Parts, SemanticIndex
from tasks.curation.waterfall import Waterfall
from tests.tasks.curation.test_dedup import (
    PROFILE,
    assert_one_survivor_per_group,
    greedy_over_all_pairs,
    planted_source,
)

THRESHOLD = 0.95


def normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def planted(n: int, dim: int = 48, seed: int = 0) -> np.ndarray:
    """Rows around 12 topics; 8% near copies of an earlier row (cosine ~0.96-0.999), some of
    them copies of copies (chains), 3% near misses (~0.90-0.94) and a blob of 60 rows within
    ~0.98 of one point. fp16, as the score stage stores them."""
    rng = np.random.default_rng(seed)
    topics = normalized(rng.normal(size=(12, dim)))
    x = 0.8 * topics[rng.integers(0, 12, n)] + 0.6 * normalized(rng.normal(size=(n, dim)))
    x = normalized(x)
    noise = normalized(rng.normal(size=(n, dim)))
    for i in rng.choice(np.arange(1, n), n // 12, replace=False):  # near copies, chains too
        x[i] = normalized(x[rng.integers(0, i)] + rng.uniform(0.03, 0.28) * noise[i])
    for i in rng.choice(np.arange(1, n), n // 30, replace=False):  # near misses
        x[i] = normalized(x[rng.integers(0, i)] + rng.uniform(0.38, 0.48) * noise[i])
    blob = rng.choice(n, 60, replace=False)
    x[blob] = normalized(x[blob[0]] + 0.1 * noise[blob])
    return (x * rng.uniform(0.5, 2.0, (n, 1))).astype(np.float16)  # any norm: cosine


def all_pairs(x: np.ndarray, threshold: float = THRESHOLD) -> np.ndarray:
    unit = normalized(x.astype(np.float64))
    return unit @ unit.T >= threshold


@pytest.mark.parametrize(("num_clusters", "max_visits"), [(1, 1), (12, 11), (12, 1)])
def test_clusters_make_the_decisions_of_all_pairs(num_clusters, max_visits):
    # With every cluster in reach visited the clustering cannot lose a pair; with one visit
    # (the default, SemDeDup visits none) these planted duplicates are all still found.
    x = planted(3000)
    rank = np.random.default_rng(1).permutation(3000)
    duplicate = all_pairs(x)
    expected = greedy_over_all_pairs(duplicate, rank)
    assert expected.sum() > 250
    index = SemanticIndex(
        Parts.from_array(x, part_rows=700),
        rank,
        THRESHOLD,
        num_clusters=num_clusters,
        max_visits=max_visits,
    )
    lost = index.losers()
    np.testing.assert_array_equal(lost, expected)
    assert_one_survivor_per_group(duplicate, rank, lost)
    assert index.rounds >= 2  # chains settle over rounds
    if num_clusters > 1:
        assert index.num_visits > 0 and index.largest_cluster < 3000
    # The rows earlier levels kept are judged among themselves, from the same layout.
    include = np.random.default_rng(2).random(3000) < 0.7
    sub = np.flatnonzero(include)
    expected_sub = np.zeros(3000, bool)
    expected_sub[sub] = greedy_over_all_pairs(duplicate[np.ix_(sub, sub)], rank[sub])
    np.testing.assert_array_equal(index.losers(include), expected_sub)


def test_blocks_boundaries_change_nothing(monkeypatch):
    x = planted(400, seed=3)
    rank = np.random.default_rng(4).permutation(400)
    expected = greedy_over_all_pairs(all_pairs(x), rank)
    monkeypatch.setattr(semantic_dedup, "QUERY_BLOCK", 3)
    monkeypatch.setattr(semantic_dedup, "REF_BLOCK", 5)
    np.testing.assert_array_equal(dedup.semantic_losers(x, rank, THRESHOLD), expected)


def test_pairs_near_the_threshold_are_decided_in_float64():
    # Pairs whose cosines straddle the threshold by 1e-5, far inside the bf16/fp16 screen's
    # error: every one is decided as float64 decides it.
    rng = np.random.default_rng(5)
    base = normalized(rng.normal(size=(40, 64)))
    copies = normalized(base + 0.33 * normalized(rng.normal(size=(40, 64))))
    x = np.concatenate([base, copies]).astype(np.float16)
    unit = normalized(x.astype(np.float64))
    sims = np.sum(unit[:40] * unit[40:], axis=1)
    threshold = float(np.median(sims))
    close = np.abs(sims - threshold) < 0.005
    assert close.sum() >= 4
    lost = dedup.semantic_losers(x, np.arange(80), threshold)
    np.testing.assert_array_equal(lost[40:], sims >= threshold)


def test_embeddings_stream_from_score_shards_in_rank_order(tmp_path):
    # Keys spread over three shards in another order than their rank: each row gets its own
    # embedding, and a key scored twice is read once.
    rng = np.random.default_rng(6)
    keys = [f"k{i:03d}" for i in range(30)]
    emb = {k: rng.normal(size=8).astype(np.float16) for k in keys}
    scores = tmp_path / "scores"
    scores.mkdir()
    for shard, chunk in enumerate([keys[20:], keys[:12], keys[12:20] + keys[:2]]):
        values = np.stack([emb[k] for k in chunk])
        table = pa.table(
            {
                "key": chunk,
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 8),
            }
        )
        pq.write_table(table, scores / f"{shard:05d}.parquet")
    ranked = list(rng.permutation(keys))
    con = duckdb.connect()
    con.register("r", pa.table({"value": ranked, "pos": np.arange(30)}))
    con.sql("CREATE TABLE ranked AS SELECT * FROM r")
    parts = dedup.score_parts(con, scores, 30)
    assert parts.dim == 8 and len(parts.readers) == 3
    got = np.zeros((30, 8), np.float16)
    seen = np.zeros(30, int)
    for read in parts.readers:
        pos, values = read()
        got[pos] = values
        seen[pos] += 1
    assert (seen == 1).all()
    np.testing.assert_array_equal(got, np.stack([emb[k] for k in ranked]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_and_cpu_make_the_same_decisions():
    x = planted(3000, seed=7)
    rank = np.random.default_rng(8).permutation(3000)
    cpu = dedup.semantic_losers(x, rank, THRESHOLD, device="cpu", num_clusters=12)
    gpu = dedup.semantic_losers(x, rank, THRESHOLD, device="cuda", num_clusters=12)
    np.testing.assert_array_equal(gpu, cpu)
    index = SemanticIndex(Parts.from_array(x), rank, THRESHOLD, device="cuda", num_clusters=12)
    missed = index.estimate_missed()  # its sample searched on the device too
    assert missed.sampled == min(semantic_dedup.MISS_SAMPLE, index.beyond_visits)


def test_a_killed_runs_embeddings_are_removed_by_the_next_run(tmp_path):
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is free now
    stale = tmp_path / f".semantic.tmp-{host}-{gone.pid}-abc"
    running = tmp_path / f".semantic.tmp-{host}-{os.getpid()}-def"
    for folder in (stale, running):
        folder.mkdir()
        (folder / "semantic-slots.npy").write_bytes(b"0" * 100)
    with dedup.semantic_workdir(tmp_path) as work:
        assert Path(work).parent == tmp_path and Path(work).is_dir()
        assert not stale.exists() and running.exists()
    assert not Path(work).exists()


def test_a_killed_runs_store_goes_whoever_holds_its_pid_now(tmp_path):
    """Issue 33: a killed run's folder goes once its lease is over, whatever its name says: the
    new run has the killed run's pid, the pid is another live process's now, or the run was on
    another host (or pod); a folder of this version whose lease ran out goes too. A live run's
    folder (its lease fresh, the rest of it old) stays."""
    host = socket.gethostname()
    over = time.time() - 24 * 3600  # killed a day ago
    other = subprocess.Popen(["sleep", "60"])  # a live process that holds the pid now
    try:
        killed = [
            tmp_path / f".semantic.tmp-{host}-{os.getpid()}-abc",
            tmp_path / f".semantic.tmp-{host}-{other.pid}-def",
            tmp_path / ".semantic.tmp-worker-7f9c-pod-4242-ghi",
            tmp_path / ".semantic.tmp-k2j3h4x9",
        ]
        live = tmp_path / ".semantic.tmp-q8w7e6r5"
        for folder in [*killed, live]:
            folder.mkdir()
            (folder / semantic_store.STORE_NAME).write_bytes(b"0" * 100)
        for folder in killed[-1], live:
            (folder / semantic_store.LEASE_NAME).write_text("{}")
        for path in [*killed, live, *(f for d in killed for f in d.iterdir())]:
            os.utime(path, (over, over))
        with dedup.semantic_workdir(tmp_path) as work:
            assert sorted(tmp_path.glob(".semantic.tmp-*")) == sorted([live, Path(work)])
    finally:
        other.kill()
        other.wait()


def test_a_running_stage_renews_its_lease(tmp_path, monkeypatch):
    """Issue 33: the lease is renewed while the stage runs, so a later run never takes a long
    run's folder for a killed one's."""
    monkeypatch.setattr(semantic_store, "RENEW_SECONDS", 0.02)
    with dedup.semantic_workdir(tmp_path) as work:
        lease = work / semantic_store.LEASE_NAME
        over = time.time() - semantic_store.EXPIRE_SECONDS - 60
        for path in work, lease:
            os.utime(path, (over, over))
        assert semantic_store.expired(work)
        deadline = time.monotonic() + 30
        while lease.stat().st_mtime == over and time.monotonic() < deadline:
            time.sleep(0.01)  # waiting for the renewing thread's next touch
        assert not semantic_store.expired(work)
        with dedup.semantic_workdir(tmp_path) as later:
            assert work.is_dir() and later.is_dir()
    assert list(tmp_path.iterdir()) == []


def test_rows_with_more_centroids_in_reach_than_visits_are_counted(monkeypatch):
    """Issue 26: a row visits its `max_visits` nearest other clusters only, and a cluster takes
    at most VISITOR_SHARE visitors per row of its own; the rows left with a centroid within
    reach that they do not visit (a duplicate there could be missed) are counted, and none are
    when every cluster can be visited."""
    x = np.random.default_rng(5).standard_normal((3000, 32)).astype(np.float32)  # isotropic
    rank = np.random.default_rng(6).permutation(3000)
    few = SemanticIndex(Parts.from_array(x), rank, 0.5, num_clusters=12, max_visits=1)
    capped = SemanticIndex(Parts.from_array(x), rank, 0.5, num_clusters=12, max_visits=11)
    monkeypatch.setattr(semantic_dedup, "VISITOR_SHARE", 100)
    every = SemanticIndex(Parts.from_array(x), rank, 0.5, num_clusters=12, max_visits=11)
    assert 0 < few.beyond_visits <= 3000
    assert 0 < capped.beyond_visits <= 3000 and capped.num_visits < 11 * 3000
    assert every.beyond_visits == 0 and every.num_visits == 11 * 3000


def isotropic_with_copies(n: int = 5000, dim: int = 64) -> np.ndarray:
    """Isotropic rows (no topics, every boundary crowded) and n/6 near copies of earlier rows."""
    rng = np.random.default_rng(0)
    x = normalized(rng.standard_normal((n, dim)))
    for i in rng.choice(np.arange(1, n), n // 6, replace=False):
        x[i] = normalized(
            x[rng.integers(0, i)] + rng.uniform(0.2, 0.45) * normalized(rng.standard_normal(dim))
        )
    return x.astype(np.float16)


def write_scores(folder: Path, x: np.ndarray) -> list[str]:
    folder.mkdir()
    keys = [f"k{i:05d}" for i in range(len(x))]
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
    pq.write_table(pa.table({"key": keys, "embedding": embedding}), folder / "00000.parquet")
    return keys


@pytest.mark.parametrize("visits", [2, 8])
def test_the_number_of_visits_is_a_profile_setting(tmp_path, monkeypatch, visits):
    """Issue 26: on an isotropic set 2 visits (the default) miss duplicates that 8 find; the
    profile's `semantic_visits` reaches the index, and the rows past it are counted."""
    # fp32 k-means whatever this CPU's screen dtype: the same clusters on every machine.
    monkeypatch.setattr(semantic_dedup, "screen", lambda device: (torch.float32, 1e-4))
    x = isotropic_with_copies()
    keys = write_scores(tmp_path / "scores", x)
    expected = greedy_over_all_pairs(all_pairs(x, 0.9), np.arange(len(x)))
    con = duckdb.connect()
    con.register("k", pa.table({"key": keys}))
    con.sql("CREATE TABLE passing AS SELECT key, NULL::VARCHAR AS reason FROM k")
    profile = FilterProfile(
        name="p", dedup=("semantic",), semantic_threshold=0.9, semantic_visits=visits
    )
    notes: dict = {}
    alone, removed = dedup.mark(con, profile, "semantic", tmp_path / "scores", notes=notes)
    dropped = con.sql("SELECT key FROM passing WHERE reason = 'duplicate_semantic'").fetchall()
    lost = np.isin(keys, [k for (k,) in dropped])
    assert not (lost & ~expected).any()  # never a row that has no better duplicate
    if visits == 2:
        assert (expected & ~lost).sum() > 0  # missed: the copy sat past the visited clusters
    else:
        np.testing.assert_array_equal(lost, expected)
    assert alone == removed == lost.sum()
    assert notes["semantic_visits"] == visits and notes["semantic_beyond_visits"] > 0


def missed_rows(index: SemanticIndex, duplicate: np.ndarray) -> np.ndarray:
    """bool [N]: rows with a duplicate (all pairs) that shares no cluster with them."""
    clusters = index.clusters_of(np.arange(len(duplicate)))
    i, j = np.nonzero(np.triu(duplicate, 1))
    a, b = clusters[i][:, :, None], clusters[j][:, None, :]
    apart = ~((a == b) & (a >= 0)).any(axis=(1, 2))
    missed = np.zeros(len(duplicate), bool)
    missed[i[apart]] = missed[j[apart]] = True
    return missed


def test_missed_duplicates_are_estimated_from_a_sample_of_the_rows_past_their_visits(
    monkeypatch,
):
    """Issue 26: on the isotropic set of the issue (8k x 256, 90 clusters), 2 visits leave rows
    with a duplicate they are never compared with; searching the rows past their visits finds
    exactly those (all of them searched) or those of the sample (scaled up to the estimate),
    and with 8 visits there are none to find."""
    monkeypatch.setattr(semantic_dedup, "screen", lambda device: (torch.float32, 1e-4))
    x = isotropic_with_copies(8000, 256)
    duplicate = all_pairs(x, 0.9)
    rank = np.arange(len(x))

    def index(visits: int, sample: int) -> SemanticIndex:
        parts = Parts.from_array(x, part_rows=3000)
        return SemanticIndex(
            parts, rank, 0.9, num_clusters=90, max_visits=visits, miss_sample=sample
        )

    every = index(2, len(x))
    truth = missed_rows(every, duplicate)
    assert every.beyond_visits >= truth.sum() > 0
    assert every.estimate_missed() == Missed(
        sampled=every.beyond_visits, missed_sample=truth.sum(), estimated=truth.sum()
    )
    some = index(2, 1000)
    in_sample = int(missed_rows(some, duplicate)[some.risk_sample].sum())
    estimated = round(in_sample / 1000 * some.beyond_visits)
    assert some.estimate_missed() == Missed(1000, in_sample, estimated)
    more = index(8, 1000)
    assert not missed_rows(more, duplicate).any()
    assert more.estimate_missed() == Missed(1000, 0, 0)


def test_the_rows_past_their_visits_and_the_missed_estimate_are_in_the_record_and_waterfall(
    fetched, scene, tmp_path, monkeypatch
):
    """Issue 26: filter-pixels passes the profile's `semantic_visits` to the index and shows
    the rows past them (`beyond_visits`) and the misses found in a sample of those rows, with
    the estimate over all, in its stats record, waterfall and galleries."""
    made = []

    class Counted(SemanticIndex):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(kwargs["max_visits"])
            self.beyond_visits = 17

        def estimate_missed(self) -> Missed:
            return Missed(sampled=12, missed_sample=3, estimated=4)

    monkeypatch.setattr(dedup, "SemanticIndex", Counted)
    planted_source(fetched, scene, tmp_path)
    profile = dataclasses.replace(PROFILE, semantic_visits=5)
    stats = filter_pixels.select_pixels(tmp_path, "src", profile, scored=True)
    assert made == [5]
    notes = {
        "semantic_visits": 5,
        "semantic_beyond_visits": 17,
        "semantic_sampled": 12,
        "semantic_missed_sample": 3,
        "semantic_missed_estimate": 4,
    }
    assert {k: stats.extra[k] for k in notes} == notes
    out = tmp_path / "src" / "selected"
    wf = Waterfall.read(out / "waterfall.json")
    assert wf.notes == notes
    for page in ("gallery.html", "gallery.md"):
        text = (out / page).read_text()
        assert "17 rows had a cluster within reach that they do not visit" in text
        assert "Of 12 of them searched, 3 had a duplicate never compared with them" in text
        assert "4 rows in all" in text


@pytest.mark.parametrize("setting", [False, True])
def test_the_store_goes_to_the_semantic_temp_folder(fetched, scene, tmp_path, monkeypatch, setting):
    """Issue 26: `SDPIPE_SEMANTIC_TEMP` names a (local) folder for the cluster-ordered store;
    unset, it stays beside the source on the data root."""
    used = []

    class Seen(SemanticIndex):
        def __init__(self, *args, **kwargs):
            used.append(Path(kwargs["workdir"]).parent)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(dedup, "SemanticIndex", Seen)
    local = tmp_path / "local" / "tmp"
    if setting:
        monkeypatch.setenv(dedup.SEMANTIC_TEMP_ENV, str(local))
    else:
        monkeypatch.delenv(dedup.SEMANTIC_TEMP_ENV, raising=False)
    planted_source(fetched, scene, tmp_path)
    filter_pixels.select_pixels(tmp_path, "src", PROFILE, scored=True)
    assert used == [local if setting else tmp_path / "src"]
    assert list(used[0].glob(".semantic.tmp-*")) == []  # removed after use


def test_the_store_on_disk_is_written_in_sequence(tmp_path, monkeypatch):
    """Issue 26: the cluster-ordered store is filled by appends (each part's rows to runs per
    bucket of clusters, then bucket by bucket in slot order), never through a writable memory
    map; it holds what the in-memory store holds, the runs are gone after, and the folder held
    at most the runs' bytes plus a bucket."""
    modes = []

    class Seen(np.memmap):
        def __new__(cls, filename, dtype=np.uint8, mode="r+", *args, **kwargs):
            modes.append(mode)
            return super().__new__(cls, filename, dtype, mode, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", Seen)
    monkeypatch.setattr(semantic_store, "BUCKET_BYTES", 20_000)  # ~20 buckets
    x = planted(3000)
    rank = np.random.default_rng(1).permutation(3000)
    built = {
        where: SemanticIndex(
            Parts.from_array(x, part_rows=700),
            rank,
            THRESHOLD,
            num_clusters=12,
            max_visits=2,
            workdir=where,
        )
        for where in (None, tmp_path)
    }
    on_disk, in_memory = built[tmp_path], built[None]
    assert modes == ["r"]
    np.testing.assert_array_equal(np.asarray(on_disk.store), in_memory.store)
    assert [p.name for p in tmp_path.iterdir()] == [semantic_store.STORE_NAME]
    np.testing.assert_array_equal(on_disk.losers(), greedy_over_all_pairs(all_pairs(x), rank))
    num_slots, dim = on_disk.store.shape
    assert 2 * dim * num_slots < on_disk.temp_bytes < 1.15 * (8 + 2 * dim) * num_slots


def test_the_cpu_screen_dtype_is_the_cpus_not_the_loads(monkeypatch, tmp_path):
    """bf16 exactly where the CPU multiplies it natively: a fixed choice per machine (a timing
    made k-means' precision, hence the clusters, depend on the machine's load)."""
    import builtins

    from tasks.curation import semantic_dedup

    real_open = builtins.open
    for flags, expected in (
        ("fpu sse2 avx2 avx512f avx512_bf16", torch.bfloat16),
        ("fpu sse2 avx2 amx_bf16 amx_tile", torch.bfloat16),
        ("fpu sse2 avx2 avx512f", torch.float32),
    ):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(
            builtins,
            "open",
            lambda path, *a, _c=cpuinfo, **k: real_open(
                _c if path == "/proc/cpuinfo" else path, *a, **k
            ),
        )
        semantic_dedup._cpu_screen_dtype.cache_clear()
        try:
            assert semantic_dedup._cpu_screen_dtype() == expected, flags
        finally:
            monkeypatch.undo()
            semantic_dedup._cpu_screen_dtype.cache_clear()
