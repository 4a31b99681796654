"""Rewriting one output file without the removed rows: each by temporary name and rename.

Files that name their rows by key (parquet tables, shard tars, keys files) are rewritten only
while they still hold a removed key, so a rewrite done twice is done once. Arrays that hold rows
by position alone (latents, token ids) are rewritten from positions the plan took before any
file changed, only while they still have their original row count: a kill between two files
and a rerun leave the same bytes as one uninterrupted run.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain.atomic import atomic_path

TOKEN_IDENTITY = (b"tokens_bytes", b"tokens_mtime_ns")  # tasks.latents.latent_keys marks


def hit(column: pa.ChunkedArray | pa.Array, keys: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.is_in(column, value_set=keys), False).to_numpy(zero_copy_only=False)


def _compression(meta: pq.FileMetaData) -> str:
    if meta.num_row_groups and meta.num_columns:
        codec = meta.row_group(0).column(0).compression
        return {"UNCOMPRESSED": "none", "LZ4_RAW": "lz4"}.get(codec, codec.lower())
    return "snappy"


def parquet(path: Path, keys: pa.Array) -> int:
    """`path` without the rows whose `key` is removed; returns the rows taken out."""
    table = pq.read_table(path)
    if "key" not in table.column_names:
        return 0
    drop = hit(table["key"], keys)
    if not drop.any():
        return 0
    kept = table.filter(pa.array(~drop)).replace_schema_metadata(table.schema.metadata)
    with atomic_path(path) as tmp:
        pq.write_table(kept, tmp, compression=_compression(pq.read_metadata(path)))
    return int(drop.sum())


def npy(path: Path, positions: np.ndarray, num_rows: int) -> int:
    """`path`'s array without the rows at `positions` (of its `num_rows` original rows); a file
    with fewer rows was rewritten already. Returns the rows taken out."""
    array = np.load(path, mmap_mode="r")
    if len(array) != num_rows:
        if len(array) == num_rows - len(positions):
            return 0
        raise ValueError(
            f"{path}: {len(array)} rows, neither the {num_rows} the removal planned on nor "
            f"{num_rows - len(positions)} after it: it changed since; run the removal again"
        )
    keep = np.ones(len(array), bool)
    keep[positions] = False
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array[keep]))
    return len(positions)


def _member_keys(members: list[tarfile.TarInfo]) -> pa.Array:
    return pa.array([m.name.split("/")[-1].split(".", 1)[0] for m in members], pa.string())


def tar_holds(path: Path, keys: pa.Array) -> bool:
    with tarfile.open(path) as src:
        return bool(hit(_member_keys(src.getmembers()), keys).any())


def tar(path: Path, keys: pa.Array) -> int:
    """A webdataset tar without the members of removed keys (`key.ext`); returns samples out."""
    with tarfile.open(path) as src:
        members = src.getmembers()
        names = _member_keys(members)
        drop = hit(names, keys)
        if not drop.any():
            return 0
        with atomic_path(path) as tmp, tarfile.open(tmp, "w", format=src.format) as out:
            for member, gone in zip(members, drop.tolist(), strict=True):
                if not gone:
                    out.addfile(member, src.extractfile(member) if member.isfile() else None)
    return len({n for n, gone in zip(names.to_pylist(), drop.tolist(), strict=True) if gone})


def removed_positions(keys_table: pa.Table, keys: pa.Array) -> dict[str, np.ndarray]:
    """Per latents file of a shard ("" legacy, else its bucket), the rows the removed keys hold;
    `token_row` under "tokens"."""
    drop = hit(keys_table["key"], keys)
    out = {"tokens": np.sort(keys_table["token_row"].to_numpy()[drop])}
    if "bucket" in keys_table.column_names:
        buckets = np.asarray(keys_table["bucket"].to_pylist(), dtype=object)
        rows = keys_table["bucket_row"].to_numpy()
        for bucket in sorted(set(buckets[drop].tolist())):
            out[bucket] = np.sort(rows[drop & (buckets == bucket)])
    else:
        out[""] = np.flatnonzero(drop)
    return out


def _shift(rows: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """Row numbers after the `removed` (sorted) rows before them are taken out."""
    return rows - np.searchsorted(removed, rows)


def keys_file(path: Path, keys: pa.Array, tokens: Path | None) -> int:
    """A shard's keys file without the removed keys, its token and bucket rows renumbered as the
    rewritten tokens and latents files hold them; marked with the tokens file there now
    (`tokens`, the live shard's) so encode still trusts it. Returns the rows taken out."""
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    drop = hit(table["key"], keys)
    if not drop.any():
        return 0
    removed = removed_positions(table, keys)
    kept = table.filter(pa.array(~drop))
    columns = {name: kept[name] for name in kept.column_names}
    token_rows = kept["token_row"].to_numpy()
    columns["token_row"] = pa.array(_shift(token_rows, removed["tokens"]), pa.int32())
    if "bucket" in kept.column_names:
        buckets = np.asarray(kept["bucket"].to_pylist(), dtype=object)
        rows = kept["bucket_row"].to_numpy().copy()
        for bucket, gone in removed.items():
            if bucket != "tokens":
                mine = buckets == bucket
                rows[mine] = _shift(rows[mine], gone)
        columns["bucket_row"] = pa.array(rows, pa.int32())
    metadata = dict(table.schema.metadata or {})
    if tokens is not None and tokens.exists() and TOKEN_IDENTITY[0] in metadata:
        st = tokens.stat()
        metadata[TOKEN_IDENTITY[0]] = str(st.st_size).encode()
        metadata[TOKEN_IDENTITY[1]] = str(st.st_mtime_ns).encode()
    out = pa.table(columns, schema=table.schema.with_metadata(metadata))
    with (
        atomic_path(path) as tmp,
        pa.OSFile(str(tmp), "wb") as sink,
        pa.ipc.new_file(sink, out.schema) as writer,
    ):
        writer.write_table(out)
    return int(drop.sum())
