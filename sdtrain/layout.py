"""A phase set on disk, as mix writes it and the trainer's ranks open it (numpy and Arrow only).

- `manifest.parquet`: one row per sample (source, shard, latent_row, token_row, key, dataset,
  and `bucket` when a drawn shard was encoded in buckets); its sha256 is part of a run's
  identity.
- `rows.npy`: int32 [N, 3], row i = (file, latent row, token row) of manifest row i, `file`
  indexing `files.json`'s list. Ranks memory-map it: the page cache holds one copy per machine.
- `files.json`: the files, the rows each must at least have, and the manifest's row count and
  fingerprint (a manifest rewritten since no longer matches its index). A file is
  `<source>-<shard>` (a legacy shard: `latents/<shard>.npy` [N, 4, h, w]) or
  `<source>-<shard>.<WxH>` (one bucket of a shard encoded in buckets: `latents/<shard>.<WxH>.npy`
  [n, V, C, H/8, W/8]); with buckets, each entry also has `bucket` ("WxH"), `views` and
  `channels`; `sources` holds, per shard the set reads, digests and stats of its keys and
  tokens files (`sdtrain.fingerprints`: a set whose sources moved their rows is refused when
  opened), and `mapped_stats.npy` the stats of the files it maps (checked as each is mapped).
- `latents/<file>.npy` and `tokens/<file>.{npy,parquet}`: links into the sources' folders.

The manifest's `bucket` is "" on the rows of a legacy shard: its file is `<source>-<shard>`, so
the file of a row is a function of (source, shard, bucket) alone; the bucket that legacy file
trains in (the square of its latents' shape) is its `files.json` entry's `bucket`. A phase set of
legacy shards only has no `bucket` column and no per-file `bucket`, `views`, `channels`, as
before; its readers take them from the latents' shape (views 1, channels 4).

A folder without `rows.npy` (written by hand, or by an older sdpipe) is indexed from the
manifest in memory instead (`derived_index`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

MANIFEST = "manifest.parquet"
BUCKET_FILE = re.compile(r"\.(\d+x\d+)$")  # `<source>-<shard>.<WxH>`: a bucket's file
ROWS = "rows.npy"
FILES = "files.json"


def column_codes(column: pa.ChunkedArray | pa.Array) -> tuple[list[str], np.ndarray]:
    """(distinct values, int32 code per row) of a string or dictionary column, no row objects."""
    if isinstance(column, pa.Array):
        column = pa.chunked_array([column])
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    column = pa.table({"c": column}).unify_dictionaries()["c"]
    if column.num_chunks == 0:
        return [], np.empty(0, np.int32)
    values = column.chunk(0).dictionary.to_pylist()
    codes = [c.indices.to_numpy(zero_copy_only=False) for c in column.chunks]
    return values, np.concatenate(codes).astype(np.int32, copy=False)


def file_name(source: str, shard: str, bucket: str = "") -> str:
    """`<source>-<shard>` (legacy shard, bucket "") or `<source>-<shard>.<bucket>`."""
    return f"{source}-{shard}.{bucket}" if bucket else f"{source}-{shard}"


def file_index(
    source: pa.ChunkedArray, shard: pa.ChunkedArray, bucket: pa.ChunkedArray | None = None
) -> tuple[list[str], np.ndarray]:
    """(file names sorted, int32 file of each row), vectorised: a file per (source, shard,
    bucket) used (`file_name`; no bucket column: every row's bucket is "")."""
    sources, source_codes = column_codes(source)
    shards, shard_codes = column_codes(shard)
    if not len(source_codes):
        return [], np.empty(0, np.int32)
    if bucket is None:
        buckets = [""]
    else:
        buckets, bucket_codes = column_codes(bucket)
    if len(sources) == 1 and len(buckets) == 1:
        pair = shard_codes
    else:
        pair = source_codes.astype(np.int64) * len(shards) + shard_codes
        if len(buckets) > 1:
            pair = pair * len(buckets) + bucket_codes
    width = len(shards) * len(buckets)
    present = np.zeros(len(sources) * width, bool)
    present[pair] = True
    used = np.flatnonzero(present)
    names = [
        file_name(
            sources[p // width], shards[p // len(buckets) % len(shards)], buckets[p % len(buckets)]
        )
        for p in used.tolist()
    ]
    order = sorted(range(len(names)), key=names.__getitem__)
    lookup = np.full(len(present), -1, np.int32)
    lookup[used[order]] = np.arange(len(order), dtype=np.int32)
    return [names[i] for i in order], lookup[pair]


def _put_int32(out: np.ndarray, column: pa.ChunkedArray) -> None:
    """A row-number column into an int32 column of `out`, chunk by chunk (no int64 copy)."""
    if column.null_count:
        raise ValueError("a latent or token row is missing (null)")
    if len(column):
        low, high = (v.as_py() for v in pc.min_max(column).values())
        if low < 0 or high > np.iinfo(np.int32).max:
            raise ValueError("a latent or token row is negative or over 2^31")
    start = 0
    for chunk in column.chunks:
        out[start : start + len(chunk)] = chunk.to_numpy()
        start += len(chunk)


def index_of(manifest: pa.Table) -> tuple[list[str], np.ndarray]:
    """(files, rows int32 [N, 3]) of a manifest table (source, shard, latent_row, token_row,
    and bucket when it has one)."""
    bucket = manifest["bucket"] if "bucket" in manifest.column_names else None
    files, file_of_row = file_index(manifest["source"], manifest["shard"], bucket)
    rows = np.empty((manifest.num_rows, 3), np.int32)
    rows[:, 0] = file_of_row
    _put_int32(rows[:, 1], manifest["latent_row"])
    _put_int32(rows[:, 2], manifest["token_row"])
    return files, rows


def needed_rows(rows: np.ndarray, num_files: int) -> tuple[np.ndarray, np.ndarray]:
    """Per file, (latent rows, token rows) its arrays must at least have: max row + 1."""
    latents = np.zeros(num_files, np.int64)
    tokens = np.zeros(num_files, np.int64)
    if len(rows):
        # Rows come in runs of one file (mix writes a dataset's rows by shard): reduce each run,
        # then the runs of each file.
        starts = np.concatenate([[0], np.flatnonzero(np.diff(rows[:, 0])) + 1])
        run_file = rows[starts, 0]
        np.maximum.at(latents, run_file, np.maximum.reduceat(rows[:, 1], starts) + 1)
        np.maximum.at(tokens, run_file, np.maximum.reduceat(rows[:, 2], starts) + 1)
    return latents, tokens


def manifest_mark(path: Path) -> str:
    """A cheap fingerprint of a manifest file: sha256 of its size, first and last MiB (a rewrite
    of its rows changes its pages; hashing all of it costs seconds at 100M rows)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()


def write_rows(folder: Path, rows: np.ndarray) -> None:
    np.save(folder / ROWS, np.ascontiguousarray(rows, np.int32))


def write_files(
    folder: Path,
    files: list[str],
    rows: np.ndarray,
    fields: list[dict] | None = None,
    sources: dict | None = None,
) -> None:
    """`files.json`, once the manifest in `folder` is complete (it holds its fingerprint).

    `fields`: per file, its `bucket`, `views`, `channels` (a set with buckets); None writes the
    legacy entries (name, latent_rows, token_rows) exactly as before. `sources`: the digests of
    the source files the set reads (`sdtrain.fingerprints`), under "sources".
    """
    latents, tokens = needed_rows(rows, len(files))
    fields = fields if fields is not None else [{}] * len(files)
    meta = {
        "num_rows": len(rows),
        "manifest": manifest_mark(folder / MANIFEST),
        "files": [
            {"name": name, **more, "latent_rows": int(n_latents), "token_rows": int(n_tokens)}
            for name, more, n_latents, n_tokens in zip(
                files, fields, latents.tolist(), tokens.tolist(), strict=True
            )
        ],
    }
    if sources is not None:
        meta["sources"] = sources
    (folder / FILES).write_text(json.dumps(meta))


def write_index(folder: Path, files: list[str], rows: np.ndarray) -> None:
    """`rows.npy` and `files.json` beside a manifest already written to `folder`."""
    write_rows(folder, rows)
    write_files(folder, files, rows)


def map_npy(path: Path) -> np.ndarray:
    """A read-only view of an .npy file's array, memory-mapped without keeping its file open."""
    return mapped_npy(path)[0]


def mapped_npy(path: Path) -> tuple[np.ndarray, os.stat_result]:
    """(a read-only view of an .npy file's array, the stat of the file descriptor mapped).

    `np.load(mmap_mode="r")` holds a file descriptor per array (Python's mmap keeps one), and a
    phase set of 10,000 shards maps 20,000 files: past a usual open-files limit. Arrow's map
    lives on in the buffer after its file is closed. The header is read from the map and the
    stat taken of its descriptor, so both are of the file mapped, whatever the path names since.
    """
    with pa.memory_map(str(path)) as mapped:
        st = os.fstat(mapped.fileno())
        buffer = mapped.read_buffer()
    header = pa.BufferReader(buffer)
    version = np.lib.format.read_magic(header)
    read_header = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
    )
    shape, fortran_order, dtype = read_header(header)
    if fortran_order:
        raise ValueError(f"{path}: a Fortran-ordered array; the phase set reads C order")
    count = int(np.prod(shape))
    array = np.frombuffer(buffer, dtype=dtype, count=count, offset=header.tell()).reshape(shape)
    return array, st


def mapped_file(array: np.ndarray) -> str | None:
    """The file whose memory map holds `array`'s data (from /proc/self/maps), else None."""
    if array.size == 0:
        return None
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def mapped_index(folder: Path) -> tuple[list[dict], np.ndarray] | None:
    """(files, rows memory-mapped) when the folder's index matches its manifest, else None."""
    if not (folder / FILES).is_file() or not (folder / ROWS).is_file():
        return None
    meta = json.loads((folder / FILES).read_text())
    if meta.get("manifest") != manifest_mark(folder / MANIFEST):
        return None
    rows = map_npy(folder / ROWS)
    if rows.shape != (meta["num_rows"], 3) or rows.dtype != np.int32:
        return None
    return with_file_fields(folder, meta["files"]), rows


def derived_index(folder: Path) -> tuple[list[dict], np.ndarray]:
    """(files, rows in RAM) from the manifest's columns: a folder without a (matching) index."""
    columns = ["source", "shard", "latent_row", "token_row"]
    strings = ["source", "shard"]
    if "bucket" in pq.read_schema(folder / MANIFEST).names:
        columns.append("bucket")
        strings.append("bucket")
    manifest = pq.read_table(folder / MANIFEST, columns=columns, read_dictionary=strings)
    names, rows = index_of(manifest)
    latents, tokens = needed_rows(rows, len(names))
    files = [
        {"name": name, "latent_rows": int(n_latents), "token_rows": int(n_tokens)}
        for name, n_latents, n_tokens in zip(names, latents.tolist(), tokens.tolist(), strict=True)
    ]
    return with_file_fields(folder, files), rows


def latent_layout(path: Path) -> tuple[str, int, int]:
    """(bucket "WxH", views, channels) of a latents file, from its .npy header alone: a legacy
    [N, C, h, w] array is one view; a bucket's [n, V, C, H/8, W/8] array has V views."""
    shape = npy_shape(path)
    if len(shape) == 4:
        views, channels = 1, shape[1]
    elif len(shape) == 5:
        views, channels = shape[1], shape[2]
    else:
        raise ValueError(f"{path}: latents of shape {shape}, neither [N,C,h,w] nor [n,V,C,h,w]")
    return f"{shape[-1] * 8}x{shape[-2] * 8}", int(views), int(channels)


def with_file_fields(folder: Path, files: list[dict]) -> list[dict]:
    """The file entries with `bucket`, `views`, `channels`: an entry written without them gets
    them from its latents' header. The legacy files of a set (`<source>-<shard>`) are of one
    shape, as the trainer has always read them: one header stands for all (a set of 10,000
    opens without reading 10,000 headers), the first that is there; a missing file is named by
    the set's reader when it maps it, and with none there the bucket is "" (unknown). A bucket's
    file (a derived index) is read, or its name says its bucket."""
    legacy: tuple[str, int, int] | None = None

    def legacy_fields() -> tuple[str, int, int]:
        nonlocal legacy
        if legacy is None:
            names = [f["name"] for f in files if "bucket" not in f]
            for name in (n for n in names if not BUCKET_FILE.search(n)):
                try:
                    legacy = latent_layout(folder / "latents" / f"{name}.npy")
                    break
                except FileNotFoundError:
                    continue
            else:  # none is there: the shape is unknown ("" bucket); a reader that needs it says so
                legacy = "", 1, 4
        return legacy

    out = []
    for entry in files:
        if "bucket" not in entry:
            name = entry["name"]
            if bucket := BUCKET_FILE.search(name):
                try:
                    fields = latent_layout(folder / "latents" / f"{name}.npy")
                except FileNotFoundError:  # named by the set's reader when it maps it
                    fields = bucket[1], 1, 4
            else:
                fields = legacy_fields()
            entry = {**entry, **dict(zip(("bucket", "views", "channels"), fields, strict=True))}
        out.append(entry)
    return out


def index_of_folder(folder: Path) -> tuple[list[dict], np.ndarray]:
    """(files, rows) of a phase set: its index memory-mapped, else derived from the manifest."""
    index = mapped_index(folder)
    return index if index is not None else derived_index(folder)


def _file_buckets(files: list[dict]) -> tuple[list[str], np.ndarray]:
    """(bucket names sorted, int32 bucket code of each file)."""
    names = sorted({f["bucket"] for f in files})
    code = {name: i for i, name in enumerate(names)}
    return names, np.array([code[f["bucket"]] for f in files], np.int32)


def row_buckets(files: list[dict], rows: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(bucket names sorted, int32 bucket code of each row of `rows`), via the rows' files."""
    names, file_bucket = _file_buckets(files)
    return names, file_bucket[np.asarray(rows[:, 0])]


def bucket_counts(
    folder_or_index: Path | tuple[list[dict], np.ndarray], which: np.ndarray | None = None
) -> dict[str, int]:
    """Rows per bucket of a phase set (a folder, or its (files, rows)), of the rows `which`
    (indices, e.g. the training rows) or all; every bucket of the set's files, 0 where none of
    the rows is. One bincount over the rows' files, then the files' counts summed per bucket
    (no per-row Python)."""
    if isinstance(folder_or_index, tuple):
        files, rows = folder_or_index
    else:
        files, rows = index_of_folder(Path(folder_or_index))
    file_of_row = np.asarray(rows[:, 0] if which is None else rows[which, 0])
    per_file = np.bincount(file_of_row, minlength=len(files))
    names, file_bucket = _file_buckets(files)
    per_bucket = np.bincount(file_bucket, weights=per_file, minlength=len(names))
    return {name: int(n) for name, n in zip(names, per_bucket.tolist(), strict=True)}


def npy_shape(path: Path) -> tuple[int, ...]:
    """The shape an .npy file's header declares (its data is not read)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(f)[0]
        return np.lib.format.read_array_header_2_0(f)[0]
