"""The partitioned metadata filter (tasks.curation.filter_partitioned) writes the filtered shards,
the waterfall and the counts exactly as the one-node filter on awkward inputs: a URL repeated
across input files and partitions, a key repeated across files (ties in the keep-rule settled by
file position), a hot URL, rows with no URL, NaN scores, files whose schemas differ, empty
partitions; and a killed task is rerun alone, reusing every finished one."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from catalog import FilterProfile
from tasks.curation import filter as filter_stage
from tasks.curation import filter_partitioned as fp
from tasks.curation.partition_files import LocalProcesses
from tests.tasks.metadata_rows import RECIPE, SCHEMA, SOURCE

LOOSE = FilterProfile(name="loose", min_side=256, dedup=("url",))


def awkward(n: int, seed: int, file: int) -> pa.Table:
    """n rows: 10% repeat a URL of an earlier file, 5% share one hot URL, 3% have no URL, 2%
    reuse a key of file 0 (with another URL or the same), NaN scores, sizes under the floor."""
    rng = np.random.default_rng(seed)
    keys = pc.utf8_lpad(pc.cast(pa.array(file * 10_000 + np.arange(n)), pa.string()), 8, "0")
    url_id = file * 10_000 + np.arange(n)
    old = rng.random(n) < 0.10
    url_id[old] = rng.integers(0, max(1, file) * 10_000, old.sum()) // 10_000 * 10_000 + (
        rng.integers(0, n, old.sum())
    )
    urls = pc.binary_join_element_wise(
        "http://h/", pc.cast(pa.array(url_id), pa.string()), ".jpg", ""
    )
    u = rng.random(n)
    urls = pc.if_else(pa.array(u < 0.05), pa.scalar("http://hot/placeholder.png"), urls)
    urls = pc.if_else(pa.array((u >= 0.05) & (u < 0.08)), pa.scalar(None, pa.string()), urls)
    if file:
        same = np.flatnonzero(rng.random(n) < 0.02)
        keys = pc.if_else(
            pa.array(np.isin(np.arange(n), same)),
            pc.utf8_lpad(pc.cast(pa.array(np.arange(n) % 50), pa.string()), 8, "0"),
            keys,
        )

    def noisy(x):
        x[rng.random(n) < 0.02] = np.nan
        return x

    columns = {
        "key": keys,
        "source": pa.array([SOURCE] * n),
        "url": urls,
        "caption": pc.binary_join_element_wise("a caption of ", keys, " "),
        "width": noisy(rng.choice([200.0, 640.0, 800.0, 1024.0], n)),
        "height": noisy(rng.choice([300.0, 600.0, 900.0], n)),
        "similarity": noisy(rng.normal(0.3, 0.03, n)),
        "punsafe": noisy(rng.beta(0.4, 8, n)),
        "pwatermark": noisy(rng.beta(0.7, 3, n)),
        "aesthetic": noisy(rng.normal(6.8, 0.6, n)),
    }
    return pa.table(columns, schema=SCHEMA)


def write_metadata(root, tables: list[pa.Table]) -> None:
    folder = root / SOURCE / "metadata"
    folder.mkdir(parents=True)
    for i, table in enumerate(tables):
        pq.write_table(table, folder / f"{i:05d}.parquet", row_group_size=700)


def outputs(root) -> tuple[dict[str, bytes], dict]:
    folder = root / SOURCE / "filtered"
    shards = {p.name: p.read_bytes() for p in sorted(folder.glob("[0-9]*.parquet"))}
    return shards, json.loads((folder / "waterfall.json").read_text())


def both(tmp_path, tables, profile, *, memory, per_shard=997, executor=None, hot_rows=None):
    """(one-node stats, partitioned stats); the two roots' shards and waterfalls are equal."""
    write_metadata(tmp_path / "one", tables)
    write_metadata(tmp_path / "parts", tables)
    one = filter_stage.filter_metadata(tmp_path / "one", SOURCE, profile, per_shard)
    parts = fp.filter_metadata(
        tmp_path / "parts",
        SOURCE,
        profile,
        per_shard,
        memory=memory,
        executor=executor,
        hot_rows=hot_rows,
    )
    shards, wf = outputs(tmp_path / "one")
    their_shards, their_wf = outputs(tmp_path / "parts")
    assert list(their_shards) == list(shards) and len(shards) > 1
    for name, data in shards.items():  # the same bytes: the same rows, order and encoding
        assert their_shards[name] == data, name
    assert their_wf == wf
    assert (parts.num_in, parts.num_out, parts.dropped) == (one.num_in, one.num_out, one.dropped)
    return one, parts


@pytest.mark.parametrize("profile", [LOOSE, RECIPE], ids=["loose", "recipe"])
def test_awkward_rows_filter_as_one_node(tmp_path, profile):
    tables = [awkward(3000, seed, file) for file, seed in enumerate((1, 2, 3))]
    one, parts = both(tmp_path, tables, profile, memory=400_000)
    assert one.dropped["duplicate_url"] > 100 and one.dropped["duplicate_key"] > 5
    assert parts.extra["partitioned"]["partitions"] >= 4
    assert not list((tmp_path / "parts" / SOURCE / "partitions").glob("filter-*"))  # committed


def hot_urls(n: int, file: int) -> pa.Table:
    """n rows of which 30% share hot URL a (some with a key of file 0: they lose by key, the
    smallest key among them first; some with no key), and in files after the first 10% share
    hot URL b (no key or a key of file 0: the first keyless row wins) and 5% hot URL c (every
    row a key of file 0: no row of c is left to keep)."""
    rng = np.random.default_rng(100 + file)
    keys = [f"{file}{i:07d}" for i in range(n)]
    urls = [f"http://h/{file}/{i}.jpg" for i in range(n)]
    u = rng.random(n)
    for i in range(n):
        taken = f"0{rng.integers(0, n) if file else i:07d}"  # a key of file 0
        if u[i] < 0.30:
            urls[i] = "http://hot/a.png"
            keys[i] = [keys[i], taken, None][int(rng.integers(0, 3))] if file else keys[i]
        elif file and u[i] < 0.40:
            urls[i], keys[i] = "http://hot/b.png", [taken, None][int(rng.integers(0, 2))]
        elif file and u[i] < 0.45:
            urls[i], keys[i] = "http://hot/c.png", taken
    # File 0 passes whole: a key of it taken later always loses to it.
    small = [0.1, 0.45, 0.45] if file else [0.0, 0.5, 0.5]
    columns = {
        "key": pa.array(keys, pa.string()),
        "source": pa.array([SOURCE] * n),
        "url": pa.array(urls),
        "caption": pa.array([f"a caption {file} {i}" for i in range(n)]),
        "width": rng.choice([200.0, 800.0, 1024.0], n, p=small),
        "height": np.full(n, 600.0),
        **{c: np.full(n, 0.3) for c in ("similarity", "punsafe", "pwatermark")},
        "aesthetic": np.full(n, 7.0),
    }
    return pa.table(columns, schema=SCHEMA)


def test_a_hot_url_is_split_across_urls_tasks(tmp_path):
    """Three URLs on thousands of rows over four files: the output is the one-node filter's,
    and no urls task holds more than a fraction of the hottest URL's rows."""
    tables = [hot_urls(1500, file) for file in range(4)]
    one, parts = both(tmp_path, tables, LOOSE, memory=60_000)
    hot_a = sum(pc.sum(pc.equal(t["url"], "http://hot/a.png")).as_py() for t in tables)
    summary = parts.extra["partitioned"]
    assert summary["partitions"] >= 8 and one.dropped["duplicate_url"] > hot_a // 2
    assert one.dropped["duplicate_key"] > 100
    assert summary["largest_urls_rows"] < hot_a / 2  # whole, a task would hold them all
    assert summary["largest_urls_share"] < 0.3


def test_every_url_repeated_in_a_file_judged_in_two_steps(tmp_path):
    """hot_rows 1: every URL on two rows of one file is spread and judged by `_hot`."""
    tables = [awkward(1500, seed, file) for file, seed in enumerate((11, 12, 13))]
    tables.append(hot_urls(500, 3))
    both(tmp_path, tables, LOOSE, memory=100_000, hot_rows=1)


def test_files_with_other_columns_and_more_partitions_than_rows(tmp_path):
    """A file with a column the others lack (read by name, as one node reads it), and most
    URL partitions and key ranges empty."""
    first = awkward(40, 4, 0)
    extra = awkward(30, 5, 1).append_column("hash", pa.array(np.arange(30, dtype=np.int64)))
    _, parts = both(tmp_path, [first, extra], LOOSE, memory=2_000, per_shard=7)
    assert parts.extra["partitioned"]["partitions"] > 15


def test_no_rows_pass(tmp_path):
    tables = [awkward(500, 6, 0)]
    strict = FilterProfile(name="strict", min_side=5000, dedup=("url",))
    write_metadata(tmp_path, tables)
    stats = fp.filter_metadata(tmp_path, SOURCE, strict, 100, memory=50_000)
    assert stats.num_out == 0 and set(stats.dropped) == {"too_small"}
    assert not list((tmp_path / SOURCE / "filtered").glob("[0-9]*.parquet"))


def test_a_killed_task_reruns_alone_reusing_finished_ones(tmp_path, monkeypatch):
    tables = [awkward(2000, seed, file) for file, seed in enumerate((7, 8))]
    write_metadata(tmp_path / "one", tables)
    expected = filter_stage.filter_metadata(tmp_path / "one", SOURCE, LOOSE, 500)
    write_metadata(tmp_path, tables)
    files = sorted((tmp_path / SOURCE / "metadata").glob("*.parquet"))
    plan = fp.make_plan(files, LOOSE, tmp_path / "work", memory=100_000)
    urls = fp._urls

    last = plan.num_parts - 1  # the others finish first (tasks run in order here)

    def dies_on_last(tmp, p, u, cuts):
        if u == last:
            urls(tmp, p, u, cuts)  # wrote its files, then the task died before its rename
            raise KeyboardInterrupt("killed")
        return urls(tmp, p, u, cuts)

    monkeypatch.setattr(fp, "_urls", dies_on_last)
    with pytest.raises(KeyboardInterrupt):
        fp.run_filter(plan, 500)
    assert list(plan.root.glob(f"urls/{last:05d}.tmp-*"))  # what the killed task left
    monkeypatch.setattr(fp, "_urls", urls)
    run = fp.run_filter(plan, 500)
    fresh = [r["task"] for r in run.records if not r["reused"]]
    downstream = ("ranges/", "hot/")  # after every urls task: none had run
    assert [t for t in fresh if not t.startswith(downstream)] == [f"urls/{last:05d}"]
    assert next(r for r in run.records if r["task"] == f"urls/{last:05d}")["stale_removed"] == 1
    fp.commit(run, tmp_path / SOURCE / "filtered", 500)
    assert run.wf.num_out == expected.num_out and run.wf.dropped == expected.dropped
    for name, data in outputs(tmp_path / "one")[0].items():
        assert (tmp_path / SOURCE / "filtered" / name).read_bytes() == data


def test_tasks_run_in_worker_processes(tmp_path):
    tables = [awkward(600, seed, file) for file, seed in enumerate((9, 10))]
    with LocalProcesses(2) as workers:
        _, parts = both(tmp_path, tables, LOOSE, memory=100_000, per_shard=101, executor=workers)
    assert parts.extra["partitioned"]["peak_task_rss_gb"] > 0
