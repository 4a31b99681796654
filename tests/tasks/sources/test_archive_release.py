"""A remote archive's copy is removed when no shard that is not done still reads it; which
shards read an archive is read from the metadata once per index run, not per release."""

from __future__ import annotations

from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.atomic import write_json_atomic
from tasks.runtime.shards import ShardStats, stats_path
from tasks.sources.adapters import base


def index(root, shards: dict[str, list[str]]) -> None:
    folder = root / "src" / "metadata"
    folder.mkdir(parents=True, exist_ok=True)
    for shard, origins in shards.items():
        pq.write_table(pa.table({"origin": origins}), folder / f"{shard}.parquet")
    num = sum(len(o) for o in shards.values())
    record = ShardStats(stage="metadata", source="src", shard="all", num_in=num, num_out=num)
    write_json_atomic(stats_path(root, "src", "metadata", "all"), asdict(record))


def done(root, shard: str) -> None:
    path = stats_path(root, "src", "shards", shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")


def test_a_copy_stays_while_an_unfinished_shard_still_reads_it(tmp_path, monkeypatch):
    index(
        tmp_path,
        {"00000": ["a.zip::1", "a.zip::2"], "00001": ["a.zip::3", "b.zip::1"], "00002": ["x.jpg"]},
    )
    reads = []
    read_table = pq.read_table
    monkeypatch.setattr(
        base.pq, "read_table", lambda *a, **k: reads.append(a) or read_table(*a, **k)
    )
    local = tmp_path / "raw" / "a.zip"
    local.parent.mkdir()
    local.write_bytes(b"zip")
    base._RAW_USERS[local] = 1
    base.release_archive(local, remove=True, reader=(tmp_path, "src", "a.zip", "00000"))
    assert local.exists()  # shard 00001 has not read it yet
    assert base._needed_later(tmp_path, "src", "b.zip", "00001") is False
    done(tmp_path, "00001")
    assert base._needed_later(tmp_path, "src", "a.zip", "00000") is False
    assert len(reads) == 3  # each metadata shard once, for every release above
    base._RAW_USERS[local] = 1
    base.release_archive(local, remove=True, reader=(tmp_path, "src", "a.zip", "00001"))
    assert not local.exists()
    # A new index run (its record rewritten) is read again.
    index(tmp_path, {"00000": ["a.zip::1"], "00003": ["a.zip::9"]})
    (tmp_path / "src" / "metadata" / "00001.parquet").unlink()
    (tmp_path / "src" / "metadata" / "00002.parquet").unlink()
    assert base._needed_later(tmp_path, "src", "a.zip", "00000") is True
    assert len(reads) == 5
