"""build-latents with the partitioned metadata filter (flows/partitioned.py) on the demo source:
the same filtered shards and filter-pixels selection as the one-node stage; a partition task
that fails fails the flow naming it, and the rerun runs only that partition and those after it
(the finished ones are reused from their folders)."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.curation import filter_partitioned
from tasks.runtime.shards import read_stats

pytestmark = pytest.mark.slow

FAILING = 1  # the keys partition that fails on its first attempt


def _build(root: Path):
    from prefect.logging.handlers import APILogWorker

    from flows.build_latents import build_latents

    state = build_latents(source="demo", data_root=str(root), workers=2, return_state=True)
    APILogWorker.drain_all()
    return state


def _tables(folder: Path) -> dict[str, list]:
    """Each shard's rows, the demo mirror's port (a build's own) left out of its URLs."""
    return {
        p.name: [
            row | ({"url": re.sub(r":\d+/", ":PORT/", row["url"])} if row.get("url") else {})
            for row in pq.read_table(p).to_pylist()
        ]
        for p in sorted(folder.glob("[0-9]*.parquet"))
    }


def test_partitioned_filter_equals_one_node_and_reruns_only_the_failed_partition(
    prefect_stack, tmp_path, monkeypatch
):
    one_node, parted = tmp_path / "one-node", tmp_path / "partitioned"
    monkeypatch.setenv("SDPIPE_PARTITIONED", "never")
    assert _build(one_node).is_completed()

    # auto: a task memory this small needs several partitions, so the partitioned path runs.
    monkeypatch.setenv("SDPIPE_PARTITIONED", "auto")
    monkeypatch.setenv(filter_partitioned.TASK_MEMORY_ENV, "4000")
    keys_work, attempts, failed = filter_partitioned._keys, [], []

    def keys_failing_once(tmp, p, k):
        attempts.append(k)
        if k == FAILING and not failed:
            failed.append(k)
            raise RuntimeError(f"keys partition {k} fails this once")
        return keys_work(tmp, p, k)

    monkeypatch.setattr(filter_partitioned, "_keys", keys_failing_once)
    state = _build(parted)
    assert state.is_failed()
    assert f"filter-keys-demo-{FAILING:05d}" in state.message
    assert not list((parted / "demo" / "filtered").glob("[0-9]*.parquet"))

    attempts.clear()
    state = _build(parted)
    assert state.is_completed(), state.message
    assert attempts == [FAILING]  # the other keys partitions were not run again
    (record,) = read_stats(parted, "demo", "filtered")
    summary = record.extra["partitioned"]
    assert summary["partitions"] > 2
    # Reused: every scatter task and every keys partition but the one that failed.
    num_inputs = len(list((parted / "demo" / "metadata").glob("*.parquet")))
    assert summary["reused"] == num_inputs + summary["partitions"] - 1

    (base,) = read_stats(one_node, "demo", "filtered")
    assert (record.num_in, record.num_out, record.dropped) == (
        base.num_in,
        base.num_out,
        base.dropped,
    )
    for stage in ("filtered", "selected"):
        tables = _tables(parted / "demo" / stage)
        assert tables and tables == _tables(one_node / "demo" / stage), stage
