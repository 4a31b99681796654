"""The shard contract: a record counts as done only while its outputs are there, and a killed
whole-stage unit leaves no temporaries behind its next run."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from catalog import FilterProfile
from sdtrain.atomic import atomic_path
from tasks.curation import filter as filter_stage
from tasks.runtime.shards import ShardStats, is_done, run_shard, stats_path
from tests.tasks.metadata_rows import row, write_metadata


def _unit(root, calls):
    def work(stats: ShardStats) -> None:
        calls.append(1)
        stats.num_in = stats.num_out = 3
        with atomic_path(root / "src" / "tokens" / "00001.parquet") as tmp:
            pq.write_table(pa.table({"key": ["a", "b", "c"]}), tmp)

    return run_shard(root, "src", "tokens", "00001", work)


def test_a_record_whose_outputs_are_gone_is_not_done(tmp_path):
    calls: list[int] = []
    first = _unit(tmp_path, calls)
    out = tmp_path / "src" / "tokens" / "00001.parquet"
    assert first.outputs == {"00001.parquet": out.stat().st_size}
    original = out.read_bytes()
    assert _unit(tmp_path, calls).skipped and len(calls) == 1

    out.unlink()  # the output deleted, its record left
    assert not is_done(tmp_path, "src", "tokens", "00001")
    again = _unit(tmp_path, calls)
    assert not again.skipped and len(calls) == 2 and out.read_bytes() == original

    out.write_bytes(b"truncated")  # an output of another size is not the recorded one
    assert not _unit(tmp_path, calls).skipped and len(calls) == 3

    shutil.rmtree(tmp_path / "src")  # the whole source folder
    assert not _unit(tmp_path, calls).skipped and out.read_bytes() == original


def test_a_record_of_an_older_sdpipe_without_outputs_is_trusted(tmp_path):
    record = stats_path(tmp_path, "src", "tokens", "00001")
    record.parent.mkdir(parents=True)
    record.write_text('{"stage": "tokens", "source": "src", "shard": "00001"}')
    assert _unit(tmp_path, []).skipped


def test_a_whole_stage_unit_removes_what_a_killed_run_left(tmp_path):
    # A kill mid-filter leaves its shard and waterfall temporaries, named after the files, not
    # after the unit ("all"): the next run of the unit removes them all.
    write_metadata(tmp_path, [row(f"k{i}") for i in range(5)])
    out = tmp_path / "src" / "filtered"
    out.mkdir(parents=True)
    left = [".00000.parquet.tmp-4242", ".waterfall.json.tmp-4242", ".gallery.html.tmp-4242"]
    for name in left:
        (out / name).write_text("partial")
    stats = filter_stage.filter_metadata(tmp_path, "src", FilterProfile(name="p"), 2)
    assert stats.num_out == 5
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert set(stats.outputs) == {
        "00000.parquet",
        "00001.parquet",
        "00002.parquet",
        "waterfall.json",
        "gallery.html",
        "gallery.md",
    }
    # Losing one of its shards undoes the whole unit: it runs again and writes it back.
    (out / "00001.parquet").unlink()
    again = filter_stage.filter_metadata(tmp_path, "src", FilterProfile(name="p"), 2)
    assert not again.skipped and (out / "00001.parquet").is_file()
