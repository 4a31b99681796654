"""Issue 26.6: memory that does not grow with the data.

- fetch-images' record: counts of failed URLs, not the URLs (they are in the shard's table);
- the memorisation scan's grouping of the training rows: Arrow, no Python object per row;
- tokenize's processes: capped (a setting), not one per core.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from flows import build_latents
from tasks.evaluation.evaluate import HeldOut
from tasks.runtime import concurrency
from tasks.runtime.node import Node
from tasks.runtime.shards import ShardStats
from tasks.sources import fetch_images


def test_the_fetch_record_counts_failed_urls_and_lists_none():
    samples = pa.table(
        {
            "key": [f"k{i}" for i in range(6)],
            "url": [f"https://x/{i}" for i in range(6)],
            "status": ["success", "http_404", "success", "timeout", "http_404", "success"],
        }
    )
    stats = ShardStats(stage="shards", source="src", shard="00000", num_in=6)
    fetch_images._count(stats, samples)
    stats.check_balanced()
    assert stats.dropped == {"http_404": 2, "timeout": 1} and stats.num_out == 3
    assert stats.extra == {"num_failed_urls": 3}
    assert "https://" not in json.dumps(stats.extra)


def test_the_memorisation_grouping_holds_no_python_object_per_row():
    n, shards = 200_000, 50
    shard = np.arange(n) % shards
    manifest = pa.table(
        {
            "source": pa.array(["laion"] * n).dictionary_encode(),
            "shard": pa.array([f"{s:05d}" for s in range(shards)]).take(pa.array(shard)),
            "key": pa.array([f"{i:012d}" for i in range(n)]),
        }
    )
    held = HeldOut(manifest, np.arange(n), np.arange(0))
    gc.collect()
    blocks = sys.getallocatedblocks()
    groups = held.by_shard(held.train_rows)
    # Python's small objects (a key as a str, a list's items) are blocks; Arrow's and numpy's
    # column buffers are not. 200k keys as Python objects would hold > 200k blocks.
    assert sys.getallocatedblocks() - blocks < 5_000
    assert len(groups) == shards and all(isinstance(v, pa.Array) for v in groups.values())
    assert groups[("laion", "00003")].to_pylist()[:2] == [f"{3:012d}", f"{53:012d}"]


def test_tokenize_runs_at_most_16_processes_by_default(monkeypatch):
    monkeypatch.delenv("SDPIPE_TOKENIZE_PROCESSES", raising=False)
    assert concurrency.tokenize_processes(128) == 16
    assert concurrency.tokenize_processes(4) == 4
    calls = []  # the process pools a tokenize unit runs its shard in
    monkeypatch.setattr(Node, "in_process", lambda self, n, fn, *args: calls.append(n))
    build_latents._tokenize_unit(Path("/data"), "laion", "00000")(Node(128))
    monkeypatch.setenv("SDPIPE_TOKENIZE_PROCESSES", "40")
    build_latents._tokenize_unit(Path("/data"), "laion", "00000")(Node(128))
    # On a cluster the unit is given the node that runs it (its agent's, of its budget).
    monkeypatch.delenv("SDPIPE_TOKENIZE_PROCESSES")
    build_latents._tokenize_unit(Path("/data"), "laion", "00000")(Node(6))
    assert calls == [16, 40, 6]
