"""The filter stages' DuckDB sessions: memory capped, spilling under the data root, and an
error that names the settings and the disk the input needs when even spilling fails."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tasks.curation import duck
from tasks.curation import filter as filter_stage
from tests.tasks.metadata_rows import RECIPE, SCHEMA, SOURCE


def many_rows(root, n: int) -> None:
    """n rows, half passing the recipe, 5% repeating an earlier URL."""
    rng = np.random.default_rng(0)
    keys = pc.utf8_lpad(pc.cast(pa.array(np.arange(n)), pa.string()), 8, "0")
    url_of = np.arange(n)
    repeats = rng.random(n) < 0.05
    url_of[repeats] = (rng.random(repeats.sum()) * np.flatnonzero(repeats)).astype(np.int64)
    urls = pc.binary_join_element_wise("http://x/", pc.take(keys, pa.array(url_of)), ".jpg", "")
    good = rng.random(n) < 0.5
    table = pa.table(
        {
            "key": keys,
            "source": pa.array([SOURCE] * n),
            "url": urls,
            "caption": pc.binary_join_element_wise("a caption of ", keys, " "),
            "width": np.full(n, 800.0),
            "height": np.full(n, 600.0),
            "similarity": np.where(good, 0.3, 0.1),
            "punsafe": np.full(n, 0.1),
            "pwatermark": np.full(n, 0.1),
            "aesthetic": rng.uniform(6.5, 8, n),
        },
        schema=SCHEMA,
    )
    (root / SOURCE / "metadata").mkdir(parents=True)
    pq.write_table(table, root / SOURCE / "metadata" / "00000.parquet")


def filtered(root) -> pa.Table:
    files = sorted((root / SOURCE / "filtered").glob("[0-9]*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files])


def test_a_memory_limit_below_the_data_spills_and_keeps_the_same_rows(tmp_path, monkeypatch):
    many_rows(tmp_path / "free", 300_000)
    many_rows(tmp_path / "capped", 300_000)
    free = filter_stage.filter_metadata(tmp_path / "free", SOURCE, RECIPE, 10_000)
    monkeypatch.setenv(duck.MEMORY_ENV, "64MB")
    sessions, spilled = [], []
    write_shards = duck.write_shards

    def connect(root=None):
        sessions.append(duck.connect(root))
        return sessions[-1]

    def write_and_measure(*args):  # the spill folder's use once the rows are judged
        size = "SELECT coalesce(sum(size), 0) FROM duckdb_temporary_files()"
        spilled.append(sessions[0].sql(size).fetchall()[0][0])
        return write_shards(*args)

    monkeypatch.setattr(filter_stage, "connect", connect)
    monkeypatch.setattr(duck, "write_shards", write_and_measure)
    capped = filter_stage.filter_metadata(tmp_path / "capped", SOURCE, RECIPE, 10_000)
    assert spilled[0] > 1_000_000
    assert capped.dropped == free.dropped and capped.num_out == free.num_out
    assert capped.dropped["duplicate_url"] > 1000
    assert filtered(tmp_path / "capped").equals(filtered(tmp_path / "free"))
    record = capped.extra["duckdb"]
    assert record["memory_limit"] == "64MB"
    assert record["temp_directory"] == str(tmp_path / "capped" / ".tmp" / "duckdb")
    assert record["spill_estimate_bytes"] > record["input_bytes"] > 0


def test_a_spill_that_cannot_fit_names_the_settings_and_the_need(tmp_path, monkeypatch):
    many_rows(tmp_path, 300_000)
    monkeypatch.setenv(duck.MEMORY_ENV, "64MB")
    monkeypatch.setenv(duck.TEMP_ENV, str(tmp_path / "spill"))

    def connect_with_a_full_disk(root=None):
        con = duck.connect(root)
        con.sql("SET max_temp_directory_size = '1MB'")  # as if its disk had 1 MB left
        return con

    monkeypatch.setattr(filter_stage, "connect", connect_with_a_full_disk)
    with pytest.raises(duck.SpillError) as info:
        filter_stage.filter_metadata(tmp_path, SOURCE, RECIPE, 10_000)
    message = str(info.value)
    assert message.startswith("DuckDB ran out of disk")
    assert "SDPIPE_DUCKDB_MEMORY" in message and "SDPIPE_DUCKDB_TEMP" in message
    assert str(tmp_path / "spill") in message and "may need up to" in message
    assert not (tmp_path / SOURCE / "filtered" / "all.stats.json").exists()


def test_memory_limit_setting(monkeypatch):
    monkeypatch.setenv(duck.MEMORY_ENV, "3GB")
    assert duck.memory_limit() == "3GB"
    monkeypatch.delenv(duck.MEMORY_ENV)
    half = int(duck.memory_limit().removesuffix("MiB"))
    ram_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    assert abs(half - ram_mib // 2) <= 1
