"""What a mix draws from: a source's encoded shards (their keys files) and a dataset's encoded view.

Nothing is materialized until rows are drawn: a view is each shard's keys file and a mask of the
rows its dataset keeps; `EncodedView.drawn` builds the samples of the drawn rows, in batches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from catalog import Catalog
from sdtrain import layout
from tasks.curation import views
from tasks.latents import latent_keys

RECORD = ".stats.json"
BATCH_ROWS = 1 << 20  # drawn rows per manifest row group (and per write handed to its thread)


class MixError(Exception):
    """A phase's datasets have nothing encoded to draw from, or less than the phase asks for."""


class EncodedShard:
    """An encoded shard: its keys file (key, token_row; and bucket, bucket_row when encoded in
    buckets) and what its latents look like. A shard's buckets are read when first asked for."""

    def __init__(self, root: Path, source: str, name: str, keys: pa.Table):
        self.root, self.source, self.name, self.keys = root, source, name, keys
        self.spec = latent_keys.spec(keys)  # None: legacy (one `<shard>.npy`, row = keys row)
        self._buckets: tuple[list[str], np.ndarray] | None = None
        self._legacy: tuple[str, int, int] | None = None
        if self.spec is not None:
            self._views_channels = int(self.spec.get("views", 1)), int(self.spec.get("channels", 4))

    @property
    def bucketed(self) -> bool:
        return self.spec is not None

    def buckets(self) -> tuple[list[str], np.ndarray]:
        """(bucket names, int32 bucket code of each keys row), from the column's dictionary."""
        if self._buckets is None:
            names = self.keys.column_names
            missing = [
                c for c in ("bucket", "bucket_row") if c not in names or self.keys[c].null_count
            ]
            if missing:
                raise MixError(
                    f"{self.source}/{self.name}: its keys file has buckets but its "
                    f"{' and '.join(missing)} is missing (on some rows); encode the shard again "
                    f"(remove {self.source}/latents/{self.name}{RECORD})"
                )
            self._buckets = layout.column_codes(self.keys["bucket"])
        return self._buckets

    def legacy_layout(self) -> tuple[str, int, int]:
        """(bucket, views, channels) of a legacy shard's `<shard>.npy`, from its header."""
        if self._legacy is None:
            path = self.root / self.source / latent_keys.STAGE / f"{self.name}.npy"
            try:
                self._legacy = layout.latent_layout(path)
            except FileNotFoundError as e:
                raise MixError(f"{self.source}/{self.name}: {path} is missing") from e
        return self._legacy

    def views_channels(self) -> tuple[int, int]:
        """(views, channels) of each latent of the shard (its spec; a legacy shard's header)."""
        if self.spec is None:
            return self.legacy_layout()[1:]
        return self._views_channels

    def label(self) -> str:
        """The shard's latent spec in words (error messages)."""
        if self.spec is None:
            return "legacy (square, 1 view, 4 channels)"
        return json.dumps(self.spec, sort_keys=True)

    def file(self, bucket: str | None, with_fields: bool) -> FileEntry:
        """The phase-set file of one bucket of this shard (None: the legacy shard's one file);
        `with_fields`: its bucket, views, channels (a set with buckets), else None."""
        if bucket is None:
            fields = self.legacy_layout() if with_fields else (None, None, None)
            return FileEntry(
                layout.file_name(self.source, self.name), self.source, self.name,
                f"{self.name}.npy", *fields,
            )  # fmt: skip
        return FileEntry(
            layout.file_name(self.source, self.name, bucket), self.source, self.name,
            f"{self.name}.{bucket}.npy", bucket, *self.views_channels(),
        )  # fmt: skip


class FileEntry(NamedTuple):
    """A file of the phase set: its name, where its latents are (`<source>/latents/<latent>`),
    and (a set with buckets) its bucket, views and channels for `files.json`."""

    name: str
    source: str
    shard: str
    latent: str
    bucket: str | None
    views: int | None
    channels: int | None

    def fields(self) -> dict:
        return {"bucket": self.bucket, "views": self.views, "channels": self.channels}


def encoded_shards(root: Path, source: str) -> list[EncodedShard]:
    """Each encoded shard (a stats record) with its keys file, in shard order. Token rows are
    trusted while the shard's tokens file is the one encode saw (size, mtime), else the keys
    are checked against that file (MixError when they differ)."""
    folder = root / source / latent_keys.STAGE
    if not folder.is_dir():
        return []
    shards = sorted(p.name[: -len(RECORD)] for p in folder.glob(f"*{RECORD}"))
    out = []
    for shard in shards:
        try:
            table = latent_keys.read(root, source, shard)
        except FileNotFoundError as e:
            raise MixError(str(e)) from e
        if _tokens_differ(root, source, shard, table):
            raise MixError(
                f"{source}/{shard}: its tokens changed since it was encoded (keys differ at "
                f"the encoded token rows); encode the shard again (remove "
                f"{folder / (shard + RECORD)})"
            )
        out.append(EncodedShard(root, source, shard, table))
    return out


def _tokens_differ(root: Path, source: str, shard: str, table: pa.Table) -> bool:
    """The shard's tokens file is not the one encode saw, and its keys disagree (a missing
    tokens file is left to the phase set, which cannot open it)."""
    if not latent_keys.tokens_path(root, source, shard).exists():
        return False
    if latent_keys.tokens_unchanged(root, source, shard, table):
        return False
    return not latent_keys.tokens_match(root, source, shard, table)


def _small(codes: np.ndarray, num_values: int) -> np.ndarray:
    """Codes as int16 where they fit: numpy's stable sort of 16-bit ints is a radix sort."""
    return codes.astype(np.int16) if num_values <= np.iinfo(np.int16).max else codes


def _dictionary(codes: np.ndarray, values: list[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(values, pa.string()))


class _Drawn(NamedTuple):
    """A shard's drawn rows: their latent rows (in the bucket's file, or the shard's), their
    rows of the keys file, and (a set with buckets) the manifest's bucket of each: names and an
    int32 code per row ("" for a legacy shard)."""

    shard: str
    latent_rows: np.ndarray
    keys: pa.Table
    bucket_names: list[str] | None = None
    bucket_codes: np.ndarray | None = None


def _samples(source: str, parts: list[_Drawn], dataset: str | None, buckets: bool = False):
    """The samples table of a source's drawn parts, in order; `buckets`: with a bucket column.

    source, shard, dataset and bucket are dictionary columns (a code per row, not a string).
    """
    counts = np.array([len(p.latent_rows) for p in parts], np.int64)
    n = int(counts.sum())
    columns = {
        "source": _dictionary(np.zeros(n, np.int8), [source]),
        "shard": _dictionary(
            np.repeat(np.arange(len(parts), dtype=np.int32), counts), [p.shard for p in parts]
        ),
        "latent_row": pa.array(
            np.concatenate([p.latent_rows for p in parts]) if parts else np.empty(0, np.int64),
            pa.int64(),
        ),
        "token_row": pa.chunked_array(
            [pc.cast(c, pa.int64()) for p in parts for c in p.keys["token_row"].chunks],
            pa.int64(),
        ),
        "key": pa.chunked_array([c for p in parts for c in p.keys["key"].chunks], pa.string()),
    }
    if dataset is not None:
        columns["dataset"] = _dictionary(np.zeros(n, np.int8), [dataset])
    if buckets:
        names: dict[str, int] = {}
        codes = [
            np.array([names.setdefault(b, len(names)) for b in p.bucket_names], np.int32)[
                p.bucket_codes
            ]
            for p in parts
        ]
        columns["bucket"] = _dictionary(
            np.concatenate(codes) if codes else np.empty(0, np.int32), list(names)
        )
    return pa.table(columns)


class EncodedView:
    """A dataset's encoded samples, held as each shard's keys file and a mask of the rows the
    view keeps: no column of samples is built until rows are drawn (`drawn`). Offers what mix
    and plan use of a table: `num_rows`, `filter(mask)`, `table()`, `view[column]`."""

    def __init__(self, source: str, dataset: str, parts: list[tuple[EncodedShard, np.ndarray]]):
        self.source, self.dataset, self.parts = source, dataset, parts
        self.counts = [int(np.count_nonzero(kept)) for _, kept in parts]
        self.num_rows = sum(self.counts)
        self.bucketed = any(shard.bucketed for shard, _ in parts)

    def _taken(self, mask: np.ndarray) -> Iterator[tuple[EncodedShard, np.ndarray]]:
        """(shard, its keys rows drawn: a mask) of each shard with rows where `mask` (over this
        view's rows, in (shard, keys row) order) is true."""
        start = 0
        for (shard, kept), count in zip(self.parts, self.counts, strict=True):
            take = kept.copy()
            take[kept] = mask[start : start + count]
            start += count
            if take.any():
                yield shard, take

    def drawn(
        self, mask: np.ndarray, buckets: bool | None = None
    ) -> Iterator[tuple[pa.Table, list]]:
        """The samples where `mask` is true, a batch of shards at a time: (samples table,
        [(files, file of each row or None for files[0], latent rows, token rows)]).

        `buckets` (default: whether this view has shards encoded in buckets): the samples get a
        `bucket` column and the files their bucket, views and channels (a phase mixing this
        view with one in buckets asks for them).
        """
        buckets = self.bucketed if buckets is None else buckets
        picked, pieces, num_picked = [], [], 0
        for shard, take in self._taken(mask):
            rows = np.flatnonzero(take)
            if shard.bucketed:
                names, codes = shard.buckets()
                codes = codes[rows]
                by_bucket = np.argsort(_small(codes, len(names)), kind="stable")
                rows, codes = rows[by_bucket], codes[by_bucket]
                keys = shard.keys.take(rows)
                # The shard's files: the buckets its drawn rows are in, each one run of rows.
                counts = np.bincount(codes, minlength=len(names))
                present = np.flatnonzero(counts)
                files = [shard.file(names[b], True) for b in present.tolist()]
                file_of_row = np.repeat(np.arange(len(present), dtype=np.int32), counts[present])
                latent_rows = pc.cast(keys["bucket_row"], pa.int64()).to_numpy()
                token_rows = keys["token_row"].to_numpy()
                pieces.append((files, file_of_row, latent_rows, token_rows))
                picked.append(_Drawn(shard.name, latent_rows, keys, names, codes))
            else:
                keys = shard.keys.filter(take)
                token_rows = keys["token_row"].to_numpy()
                pieces.append(([shard.file(None, buckets)], None, rows, token_rows))
                picked.append(_Drawn(shard.name, rows, keys, [""], np.zeros(len(rows), np.int32)))
            num_picked += len(rows)
            if num_picked >= BATCH_ROWS:
                yield _samples(self.source, picked, self.dataset, buckets), pieces
                picked, pieces, num_picked = [], [], 0
        if picked:
            yield _samples(self.source, picked, self.dataset, buckets), pieces

    def drawn_buckets(self, mask: np.ndarray) -> Iterator[tuple[list[str], np.ndarray]]:
        """(bucket names, int32 code of each drawn row) of each shard with rows where `mask` is
        true, in manifest order (by bucket, as `drawn`): a legacy shard's rows are all in the
        square of its latents."""
        for shard, take in self._taken(mask):
            if shard.bucketed:
                names, codes = shard.buckets()
                counts = np.bincount(codes[take], minlength=len(names))
                yield names, np.repeat(np.arange(len(names), dtype=np.int32), counts)
            else:
                yield [shard.legacy_layout()[0]], np.zeros(int(np.count_nonzero(take)), np.int32)

    def latent_layouts(self) -> dict[str, tuple[int, int]]:
        """Per bucket this view's shards have, (views, channels) of its latents."""
        found = {}
        for shard, _ in self.parts:
            names = shard.buckets()[0] if shard.bucketed else [shard.legacy_layout()[0]]
            found |= dict.fromkeys(names, shard.views_channels())
        return found

    def filter(self, mask) -> pa.Table:
        """The drawn samples as one table (source, shard, latent_row, token_row, key, dataset,
        and bucket for a view with shards in buckets)."""
        if isinstance(mask, pa.Array | pa.ChunkedArray):
            mask = mask.to_numpy(zero_copy_only=False)
        tables = [table for table, _ in self.drawn(np.asarray(mask, bool))]
        if tables:
            return pa.concat_tables(tables)
        return _samples(self.source, [], self.dataset, self.bucketed)

    def table(self) -> pa.Table:
        return self.filter(np.ones(self.num_rows, bool))

    def __getitem__(self, column: str) -> pa.ChunkedArray:
        return self.table()[column]


def _view_runs(groups: Iterator[pa.Table]) -> Iterator[tuple[str, pa.Array]]:
    """(shard, keys) of a view's row groups, one run of a shard at a time (a view is sorted by
    shard; a run cut by a row group's end comes in two). The next row group is read in a
    thread while this one is joined."""
    with ThreadPoolExecutor(1) as reader:
        ahead = reader.submit(next, groups, None)
        while (group := ahead.result()) is not None:
            ahead = reader.submit(next, groups, None)
            for batch in group.to_batches():
                shard_column, keys = batch.column(0), batch.column(1)
                if not pa.types.is_dictionary(shard_column.type):
                    shard_column = shard_column.dictionary_encode()
                names = shard_column.dictionary.to_pylist()
                codes = shard_column.indices.to_numpy(zero_copy_only=False)
                bounds = [0, *(np.flatnonzero(np.diff(codes)) + 1).tolist(), len(codes)]
                for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                    if b > a:
                        yield names[codes[a]], keys.slice(a, b - a)


def dataset_view(root: Path, catalog: Catalog, dataset: str) -> EncodedView:
    """The encoded samples of a dataset: its materialized view's keys (`tasks.curation.views`,
    built or refreshed here when missing or stale) that its source encoded, in (shard, latent_row)
    order. The join is one shard's keys at a time, while the view's next row group is read."""
    ds = catalog.dataset(dataset)
    encoded = {shard.name: shard for shard in encoded_shards(root, ds.source)}
    kept: dict[str, np.ndarray] = {}
    for shard, keys in _view_runs(views.view_key_groups(root, catalog, dataset)):
        table = encoded.get(shard)
        if table is None:
            continue
        found = pc.is_in(table.keys["key"], value_set=keys).to_numpy(zero_copy_only=False)
        kept[shard] = found if shard not in kept else kept[shard] | found
    parts = [(s, kept[name]) for name, s in encoded.items() if name in kept and kept[name].any()]
    _one_spec(dataset, ds.source, [s for s, _ in parts])
    return EncodedView(ds.source, dataset, parts)


def _one_spec(dataset: str, source: str, shards: list[EncodedShard]) -> None:
    """MixError unless the dataset's shards share one latent spec: a batch of the dataset's
    rows must read alike (e.g. some flipped and some not is a half re-encoded source)."""
    groups: dict[str, list[str]] = {}
    for shard in shards:
        groups.setdefault(shard.label(), []).append(shard.name)
    if len(groups) <= 1:
        return

    def listed(names: list[str]) -> str:
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return ", ".join(names[:5]) + more

    by_spec = "; ".join(f"{listed(names)}: {spec}" for spec, names in groups.items())
    raise MixError(
        f"dataset {dataset!r}: the shards of {source} were encoded under different latent specs "
        f"({by_spec}); run build-latents for {source} so encode redoes every shard not encoded "
        "under the model's current spec, then mix again"
    )
