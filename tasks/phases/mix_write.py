"""The phase set's writers: the manifest (written by a thread while the next rows are drawn), the
row index of its latent files, and the symlinks to those files."""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain import layout
from tasks.phases.mix_read import FileEntry


class ManifestWriter:
    """The manifest's tables written in order by one thread while the caller draws the next
    (at most two wait). Plain string and int64 columns to a reader, as before: store_schema is
    off, so the dictionary columns are only the file's encoding."""

    def __init__(self, path: Path):
        self.path, self.writer = path, None
        self.pool = ThreadPoolExecutor(1)
        self.pending: deque = deque()

    def __enter__(self) -> ManifestWriter:
        return self

    def write(self, table: pa.Table) -> None:
        while len(self.pending) >= 2:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._write, table))

    def _write(self, table: pa.Table) -> None:
        if self.writer is None:
            dictionaries = [f.name for f in table.schema if pa.types.is_dictionary(f.type)]
            self.writer = pq.ParquetWriter(
                self.path, table.schema, store_schema=False, use_dictionary=dictionaries or True
            )
        self.writer.write_table(table)

    def __exit__(self, *exc) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown()
            if self.writer is not None:
                self.writer.close()


class RowIndex:
    """The phase set's row index, filled as rows are drawn: int32 (file, latent row, token
    row) per manifest row, files numbered in order of first use (a shard's bucket files in the
    order of its buckets). Rows drawn from a plain table (a view a test planted) are indexed
    from the manifest's columns at the end."""

    def __init__(self, num_rows: int):
        self.rows = np.empty((num_rows, 3), np.int32)
        self.files: dict[str, int] = {}
        self.entries: list[FileEntry] = []
        self.filled = 0
        self.planted: list[pa.Table] = []

    def _file(self, entry: FileEntry) -> int:
        number = self.files.setdefault(entry.name, len(self.files))
        if number == len(self.entries):
            self.entries.append(entry)
        return number

    def add(self, table: pa.Table, pieces: list | None) -> None:
        if pieces is None:
            self.planted.append(table)
            return
        for files, file_of_row, latent_rows, token_rows in pieces:
            n = len(latent_rows)
            numbers = np.array([self._file(f) for f in files], np.int32)
            block = self.rows[self.filled : self.filled + n]
            block[:, 0] = numbers[0] if file_of_row is None else numbers[file_of_row]
            block[:, 1] = latent_rows
            block[:, 2] = token_rows
            self.filled += n

    def result(self) -> tuple[list[FileEntry], np.ndarray]:
        """(files, rows)."""
        if self.planted:
            if self.files:
                raise ValueError("mix: planted and encoded views in one phase")
            manifest = pa.concat_tables(self.planted)
            names, self.rows = layout.index_of(manifest)
            pairs = set(
                zip(manifest["source"].to_pylist(), manifest["shard"].to_pylist(), strict=True)
            )
            where = {f"{source}-{shard}": (source, shard) for source, shard in pairs}
            files = [FileEntry(n, *where[n], f"{where[n][1]}.npy", None, None, None) for n in names]
            return files, self.rows
        if self.filled != len(self.rows):
            raise AssertionError(f"mix: {self.filled} rows drawn of {len(self.rows)}")
        return self.entries, self.rows


def link_files(root: Path, folder: Path, files: list[FileEntry]) -> None:
    """Relative links (the data root stays movable) to each file's latents and tokens (the
    bucket files of one shard link its one tokens file each)."""
    has_ids: dict[tuple[str, str], bool] = {}
    latents, tokens = f"{folder}/latents", f"{folder}/tokens"  # strings: 3 links per file
    for f in files:
        up = f"../../../{f.source}"
        os.symlink(f"{up}/latents/{f.latent}", f"{latents}/{f.name}.npy")
        os.symlink(f"{up}/tokens/{f.shard}.parquet", f"{tokens}/{f.name}.parquet")
        pair = (f.source, f.shard)
        if pair not in has_ids:
            has_ids[pair] = os.path.exists(f"{root}/{f.source}/tokens/{f.shard}.npy")
        if has_ids[pair]:
            os.symlink(f"{up}/tokens/{f.shard}.npy", f"{tokens}/{f.name}.npy")
