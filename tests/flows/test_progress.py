"""Terminal progress: per stage shards done / total, samples/s and ETA read from the data root; a
live display on a terminal (checked through a pty), plain lines in a log."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import progress
from tasks.runtime.shards import run_shard

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _samples(n: int):
    def work(stats):
        stats.num_in = stats.num_out = n

    return work


def _boom(stats):
    raise OSError("disk full")


def _filtered(root: Path, num_shards: int) -> None:
    def work(stats):
        (root / "src" / "filtered").mkdir(parents=True, exist_ok=True)
        for i in range(num_shards):
            (root / "src" / "filtered" / f"{i:05d}.parquet").write_bytes(b"")
        stats.num_in = stats.num_out = 96

    run_shard(root, "src", "filtered", "all", work)


def test_stage_lines_from_the_records(tmp_path):
    root = tmp_path
    # A resumed run: metadata and filter done before, one of four fetch shards too.
    for shard in ("00000", "00001"):
        run_shard(root, "src", "metadata", shard, _samples(50))
    _filtered(root, 4)
    run_shard(root, "src", "shards", "00000", _samples(24))
    watcher = progress.Watcher(root, sources=["src"])
    lines = {line.label: line for line in watcher.poll(now=100.0)}
    assert list(lines) == ["fetch-metadata src", "filter src", "fetch-images src"]
    # The metadata files are the flow's to count; a later stage began, so it had them all.
    assert lines["fetch-metadata src"].text() == "fetch-metadata src: 2/2 shards, done"
    assert lines["filter src"].text() == "filter src: 1/1, done"
    # Done before the watch: counted as done, not in the rate (nothing ran yet).
    assert lines["fetch-images src"].text() == "fetch-images src: 1/4 shards"

    (root / "src" / "shards" / ".00001.tar.tmp-77").write_bytes(b"")  # shard 1 starts
    watcher.poll(now=101.0)
    (root / "src" / "shards" / ".00001.tar.tmp-77").unlink()
    run_shard(root, "src", "shards", "00001", _samples(24))
    with pytest.raises(OSError):
        run_shard(root, "src", "shards", "00002", _boom)
    fetch = {line.label: line for line in watcher.poll(now=113.0)}["fetch-images src"]
    # Started between the polls at 100 and 101: 24 samples in 13 s; 1 shard left at 13 s each.
    assert (fetch.done, fetch.total, fetch.failed) == (2, 4, 1)
    assert fetch.rate == pytest.approx(24 / 13) and fetch.eta_s == pytest.approx(13)
    assert fetch.text() == "fetch-images src: 2/4 shards, 1 failed, 1.8 samples/s, ETA 13s"

    run_shard(root, "src", "shards", "00003", _samples(24))
    fetch = {line.label: line for line in watcher.poll(now=120.0)}["fetch-images src"]
    assert fetch.finished and fetch.text().endswith("2.4 samples/s, done")  # 48 in 20 s


def test_training_line_from_the_log(tmp_path):
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (tmp_path / "phases" / "demo").mkdir(parents=True)
    (tmp_path / "phases" / "demo" / "mix.json").write_text(json.dumps({"num_samples": 240}))
    log = run / "log.jsonl"

    def step(n: int) -> str:
        return json.dumps({"step": n, "loss": 0.5, "samples_per_s": 16.0, "total_steps": 24})

    log.write_text(step(4) + "\n" + step(8)[:10])  # the second line is still being written
    watcher = progress.Watcher(tmp_path, phases=["demo"])
    mix, train = watcher.poll(now=50.0)
    assert mix.text() == "mix demo: 240/240 samples, done"
    assert train.text() == "train demo: 4/24 steps, 16.0 samples/s"
    log.write_text(step(4) + "\n" + step(8) + "\n" + step(12) + "\n")
    _, train = watcher.poll(now=54.0)
    assert train.text() == "train demo: 12/24 steps, 16.0 samples/s, ETA 6s"  # 2 steps/s
    (run / "summary.json").write_text("{}")
    log.write_text(log.read_text() + step(24) + "\n")
    assert watcher.poll(now=60.0)[1].text() == "train demo: 24/24 steps, 16.0 samples/s, done"


# A stage of two shards written while progress.watch shows it, on whatever stderr is, with
# Prefect's logging set up as the CLI has it (its console, its theme) and a log line between.
CHILD = """
import logging, sys, time
from pathlib import Path
import prefect.main  # sets up Prefect's logging: the root logger prints on its console
from flows.cli import progress
from tasks.runtime.shards import run_shard

root = Path(sys.argv[1])
(root / "src" / "filtered").mkdir(parents=True)
for i in range(2):
    (root / "src" / "filtered" / f"{i:05d}.parquet").write_bytes(b"")

def work(stats):
    time.sleep(0.7)
    stats.num_in = stats.num_out = 24

with progress.watch(root, sources=["src"]):
    for i in range(2):
        run_shard(root, "src", "shards", f"{i:05d}", work)
        logging.getLogger("sdpipe").warning("shard %d written", i)
"""


def _child_env() -> dict[str, str]:
    return {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "PYTHONUNBUFFERED": "1"}


def test_a_terminal_gets_a_live_display(tmp_path):
    leader, follower = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=PROJECT_ROOT,
        env=_child_env(),
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert child.wait(timeout=60) == 0, out.decode(errors="replace")
    text = out.decode(errors="replace")
    assert "\x1b[?25l" in text and "\x1b[2K" in text  # cursor hidden, the line redrawn in place
    assert "fetch-images src" in text and "2/2 shards" in text and "done" in text
    assert "progress:" not in text
    assert "shard 0 written" in text and "shard 1 written" in text  # logs go on, above it


def test_a_log_gets_plain_lines(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=PROJECT_ROOT,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("progress: ")]
    assert lines[0] == "progress: fetch-images src: 1/2 shards" or lines[0].startswith(
        "progress: fetch-images src: 1/2 shards, "
    )
    assert lines[-1].startswith("progress: fetch-images src: 2/2 shards, ")
    assert lines[-1].endswith(" samples/s, done") and len(lines) == 2
    assert "shard 1 written" in done.stderr
