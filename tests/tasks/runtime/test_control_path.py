"""Issue 26.5: per-shard bookkeeping that does not grow with the shard count.

- a shard's record and its temporaries: no listing of its stage folder (a folder of every
  shard's files), unless a killed run of that shard left its marker;
- the progress watcher: once the stage runs, a poll reads the journal's new lines, not the folder;
- a phase set's open (tests/sdtrain/test_phase_set_open.py);
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flows.cli import progress
from sdtrain.atomic import atomic_path
from tasks.runtime.shards import ShardStats, run_shard, stats_path


def _work(root: Path, shard: str):
    def work(stats: ShardStats) -> None:
        folder = root / "src" / "tokens"
        for suffix in ("npy", "parquet"):
            with atomic_path(folder / f"{shard}.{suffix}") as tmp:
                tmp.write_bytes(b"x" * 7)
        stats.num_in = stats.num_out = 2

    return work


def _fail(stats: ShardStats) -> None:
    raise RuntimeError("the work failed")


@pytest.fixture
def no_listing(monkeypatch):
    """Listing any folder fails: what must not happen per shard."""

    def refuse(*args, **kwargs):
        raise AssertionError("a folder was listed")

    def arm():
        monkeypatch.setattr(Path, "iterdir", refuse)
        monkeypatch.setattr(Path, "glob", refuse)
        monkeypatch.setattr(os, "scandir", refuse)
        monkeypatch.setattr(os, "listdir", refuse)

    return arm


def test_a_shard_record_and_its_temporaries_list_no_folder(tmp_path, no_listing):
    for i in range(3):  # other shards' files in the folder
        run_shard(tmp_path, "src", "tokens", f"{i:05d}", _work(tmp_path, f"{i:05d}"))
    no_listing()
    stats = run_shard(tmp_path, "src", "tokens", "00003", _work(tmp_path, "00003"))
    assert stats.outputs == {"00003.npy": 7, "00003.parquet": 7}
    record = json.loads(stats_path(tmp_path, "src", "tokens", "00003").read_text())
    assert record["outputs"] == stats.outputs


def test_the_temporaries_of_a_killed_run_of_a_shard_are_still_removed(tmp_path):
    folder = tmp_path / "src" / "tokens"
    folder.mkdir(parents=True)
    # A run of 00001 killed mid-write: its marker and a temporary; 00002's is running now.
    (folder / ".00001.unit.tmp-running").touch()
    (folder / ".00001.npy.tmp-4242").write_bytes(b"partial")
    (folder / ".00002.npy.tmp-4343").write_bytes(b"another shard's")
    run_shard(tmp_path, "src", "tokens", "00001", _work(tmp_path, "00001"))
    hidden = sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
    assert hidden == [".00002.npy.tmp-4343"]


def test_the_progress_watcher_reads_the_journal_not_the_folder_once_a_stage_runs(
    tmp_path, no_listing
):
    root = tmp_path
    for i in range(3):
        run_shard(root, "src", "tokens", f"{i:05d}", _work(root, f"{i:05d}"))
    watcher = progress.Watcher(root, sources=["src"])
    watcher.poll(now=10.0)
    run_shard(root, "src", "tokens", "00003", _work(root, "00003"))
    watcher.poll(now=11.0)  # the stage started: seen
    no_listing()
    for i in range(4, 8):
        run_shard(root, "src", "tokens", f"{i:05d}", _work(root, f"{i:05d}"))
    with pytest.raises(RuntimeError):
        run_shard(root, "src", "tokens", "00008", _fail)
    [line] = [w for w in watcher.poll(now=12.0) if w.label.startswith("tokenize")]
    assert (line.done, line.failed) == (8, 1)
    assert line.rate == pytest.approx(5 * 2 / 2.0)  # 5 new shards of 2 samples since 10.0
