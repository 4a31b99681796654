"""`sdpipe status` reads done / running / failed shards and phases from the data root alone."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from tasks.runtime.shards import failure_path, run_shard, stats_path


def _ok(stats):
    stats.num_in = stats.num_out = 10


def _boom(stats):
    raise OSError("disk full")


def test_failure_record_is_written_then_cleared(tmp_path):
    with pytest.raises(OSError, match="disk full"):
        run_shard(tmp_path, "demo", "latents", "00001", _boom)
    record = json.loads(failure_path(tmp_path, "demo", "latents", "00001").read_text())
    assert record["error"] == "OSError" and record["message"] == "disk full"
    assert {"host", "pid", "seconds", "time"} <= set(record)
    run_shard(tmp_path, "demo", "latents", "00001", _ok)  # the retry succeeds
    assert stats_path(tmp_path, "demo", "latents", "00001").exists()
    assert not failure_path(tmp_path, "demo", "latents", "00001").exists()


def test_status_counts_from_disk(tmp_path, capsys):
    root = tmp_path
    (root / "demo" / "filtered").mkdir(parents=True)
    for shard in ("00000", "00001", "00002", "00003"):
        (root / "demo" / "filtered" / f"{shard}.parquet").write_bytes(b"")
        run_shard(root, "demo", "shards", shard, _ok)
    run_shard(root, "demo", "latents", "00000", _ok)
    with pytest.raises(OSError):
        run_shard(root, "demo", "latents", "00001", _boom)
    (root / "demo" / "latents" / ".00002.npy.tmp-4242").write_bytes(b"half")  # in progress
    (root / "phases" / "demo").mkdir(parents=True)
    (root / "phases" / "demo" / "mix.json").write_text(json.dumps({"num_samples": 48}))
    (root / "runs" / "demo").mkdir(parents=True)
    (root / "runs" / "demo" / "log.jsonl").write_text('{"step": 3, "loss": 0.1}\n{"step": 4')

    assert main(["--data-root", str(root), "status"]) == 1  # something failed
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    # stage done running failed todo in out
    assert lines["fetch-images"][1:5] == ["4", "0", "0", "0"]
    assert lines["encode"][1:5] == ["1", "1", "1", "1"]
    assert "failed 00001: OSError: disk full" in out
    assert "phase demo: mix done (48 samples), train running step 3" in out

    assert main(["--data-root", str(root), "status", "--json", "demo"]) == 1
    report = json.loads(capsys.readouterr().out)
    encode = {s["stage"]: s for s in report["sources"]["demo"]}["encode"]
    assert (encode["done"], encode["running"], encode["failed"], encode["todo"]) == (1, 1, 1, 1)
    assert encode["num_out"] == 10


def test_status_of_an_empty_root(tmp_path, capsys):
    assert main(["--data-root", str(tmp_path / "none"), "status"]) == 0
    assert "nothing yet" in capsys.readouterr().out
