"""A removal list: read (parquet or one per line), resolved to the source's sample keys, kept.

An entry is a URL, the metadata's int64 `hash`, the fetched image's sha256 or a sample key. A
line of digits may be a hash or a key, so it is looked up as both. `widen` adds every sample
whose image has a matched image's sha256 or a pHash within the profile's near-duplicate radius.
What matched joins `<root>/<source>/removals/blocklist.parquet` (key, url, hash, sha256, origin
of each removed row), which every later build applies (reason `removed`): fetch-metadata by URL
and hash, an archive source's index by origin and its repack by sha256; the catalog's own
`blocklist` option stays the user's. Columnar throughout: Arrow `is_in` per file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain.atomic import atomic_path

FOLDER = "removals"
BLOCKLIST = "blocklist.parquet"
KINDS = ("url", "hash", "sha256", "key")
# `origin`: an archive source's member path, what its index step drops by (keys are positions)
BLOCK_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("url", pa.string()),
        ("hash", pa.int64()),
        ("sha256", pa.string()),
        ("origin", pa.string()),
    ]
)
KEPT = (*KINDS, "origin")  # what a blocklist row keeps of a removed row
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_INT = re.compile(r"^-?[0-9]+$")


class RemovalError(ValueError):
    """A removal list that cannot be read, or a removal that cannot be done as asked."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """The list's entries by kind, each a unique Arrow array."""

    url: pa.Array
    hash: pa.Array
    sha256: pa.Array
    key: pa.Array
    digest: str  # sha256 of the list file's bytes: the removal's name

    @property
    def num_entries(self) -> int:
        return sum(len(getattr(self, k)) for k in KINDS)


def read_list(path: Path) -> Wanted:
    """The entries of a parquet (columns among url, hash, sha256, key) or text file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RemovalError(f"removal list {path}: cannot read it ({e.strerror})") from None
    digest = hashlib.sha256(data).hexdigest()
    found: dict[str, list] = {k: [] for k in KINDS}
    if data[:4] == b"PAR1":
        table = pq.read_table(path)
        columns = [c for c in KINDS if c in table.column_names]
        if not columns:
            raise RemovalError(
                f"removal list {path}: a parquet list needs a column among {', '.join(KINDS)}; "
                f"found {', '.join(table.column_names)}"
            )
        for c in columns:
            found[c] = [v for v in table[c].to_pylist() if v is not None]
    else:
        for line in data.decode("utf-8", "replace").splitlines():
            entry = line.strip()
            if not entry or entry.startswith("#"):
                continue
            if "://" in entry:
                found["url"].append(entry)
            elif _SHA256.match(entry):
                found["sha256"].append(entry.lower())
            elif _INT.match(entry):  # a hash or a key of digits: looked up as both
                if -(2**63) <= int(entry) < 2**63:
                    found["hash"].append(int(entry))
                found["key"].append(entry)
            else:
                found["key"].append(entry)
    types = {"url": pa.string(), "hash": pa.int64(), "sha256": pa.string(), "key": pa.string()}
    arrays = {k: pc.unique(pa.array(found[k], types[k])) for k in KINDS}
    return Wanted(**arrays, digest=digest)


def _hits(table: pa.Table, wanted: Wanted) -> np.ndarray:
    hit = np.zeros(table.num_rows, bool)
    for kind in KINDS:
        values = getattr(wanted, kind)
        if kind in table.column_names and len(values):
            column = table[kind]
            if kind == "hash":
                column = pc.cast(column, pa.int64())
            elif kind == "sha256":
                column = pc.utf8_lower(column)
            hit |= pc.fill_null(pc.is_in(column, value_set=values), False).to_numpy(
                zero_copy_only=False
            )
    return hit


def _tables(source_dir: Path):
    """The source's sample tables holding identifiers: metadata rows and fetched shard rows."""
    for folder, columns in (("metadata", ("key", "url", "hash", "origin")), ("shards", KEPT)):
        for path in sorted((source_dir / folder).glob("[0-9]*.parquet")):
            names = pq.read_schema(path).names
            yield folder, pq.read_table(path, columns=[c for c in columns if c in names])


def resolve(source_dir: Path, wanted: Wanted, *, widen: bool = False, radius: int = 0) -> pa.Table:
    """The rows of the source the list names (BLOCK_SCHEMA, one per key, sorted by key): every
    metadata and fetched-shard table is read a file at a time, identifier columns only."""
    parts = []
    for _, table in _tables(source_dir):
        hit = _hits(table, wanted)
        if hit.any():
            parts.append(_block_rows(table.filter(pa.array(hit))))
    found = _merge(parts)
    if widen:
        found = _merge([found, *_widened(source_dir, found, radius)])
    return found


def resolve_root(root: Path, wanted: Wanted) -> tuple[pa.Array, pa.Array]:
    """(URLs, keys) the list names over every source of a data root: its own URLs and keys, and
    those of each row a hash or sha256 of it matches in a source's sample tables or in the rows
    a removal took out (`removals/blocklist.parquet`: gone from the tables, still named here)."""
    if not len(wanted.hash) and not len(wanted.sha256):
        return wanted.url, wanted.key  # nothing to look up: the sets' copies hold both
    root = Path(root)
    parts = []
    for source_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        if not any((source_dir / f).is_dir() for f in ("metadata", "shards", FOLDER)):
            continue
        parts.append(resolve(source_dir, wanted))
        blocked = read_blocklist(root, source_dir.name)
        hit = _hits(blocked, wanted)
        if hit.any():
            parts.append(blocked.filter(pa.array(hit)))
    found = _merge(parts)
    urls = pc.unique(pa.concat_arrays([wanted.url, pc.drop_null(found["url"]).combine_chunks()]))
    keys = pc.unique(pa.concat_arrays([wanted.key, found["key"].combine_chunks()]))
    return urls, keys


def _block_rows(table: pa.Table) -> pa.Table:
    n = table.num_rows
    columns = {}
    for field in BLOCK_SCHEMA:
        if field.name in table.column_names:
            columns[field.name] = pc.cast(table[field.name], field.type)
        else:
            columns[field.name] = pa.nulls(n, field.type)
    return pa.table(columns, schema=BLOCK_SCHEMA)


def _merge(parts: list[pa.Table]) -> pa.Table:
    """One row per key (its known url, hash, sha256 gathered from every table), key order."""
    if not parts:
        return BLOCK_SCHEMA.empty_table()
    table = pa.concat_tables(parts)
    grouped = table.group_by("key").aggregate([(c, "max") for c in KEPT if c != "key"])
    grouped = grouped.rename_columns([c.removesuffix("_max") for c in grouped.column_names]).select(
        BLOCK_SCHEMA.names
    )
    return grouped.cast(BLOCK_SCHEMA).sort_by("key")


def _widened(source_dir: Path, found: pa.Table, radius: int) -> list[pa.Table]:
    """Fetched rows whose image has a found row's sha256, or a pHash within `radius` of one."""
    hashes = pc.unique(pc.drop_null(found["sha256"]))
    keys = found["key"]
    phashes = []
    for path in sorted((source_dir / "scores").glob("[0-9]*.parquet")):
        if "phash" in pq.read_schema(path).names:
            t = pq.read_table(path, columns=["key", "phash"])
            mask = pc.fill_null(pc.is_in(t["key"], value_set=keys), False)
            phashes.append(pc.drop_null(t.filter(mask)["phash"]).to_numpy().astype(np.uint64))
    near = np.unique(np.concatenate(phashes)) if phashes else np.empty(0, np.uint64)
    out = []
    for path in sorted((source_dir / "shards").glob("[0-9]*.parquet")):
        names = pq.read_schema(path).names
        if "sha256" not in names:
            continue
        t = pq.read_table(path, columns=[c for c in KEPT if c in names])
        hit = pc.fill_null(pc.is_in(t["sha256"], value_set=hashes), False).to_numpy(
            zero_copy_only=False
        )
        scores = source_dir / "scores" / path.name
        if len(near) and scores.exists() and "phash" in pq.read_schema(scores).names:
            s = pq.read_table(scores, columns=["key", "phash"])
            close = near_keys(s, near, radius)
            hit |= pc.is_in(t["key"], value_set=close).to_numpy(zero_copy_only=False)
        if hit.any():
            out.append(_block_rows(t.filter(pa.array(hit))))
    return out


def near_keys(scores: pa.Table, near: np.ndarray, radius: int) -> pa.Array:
    """Keys of `scores` whose pHash is within Hamming `radius` of one of `near` (uint64)."""
    column = scores["phash"]
    valid = pc.is_valid(column).to_numpy(zero_copy_only=False)
    values = pc.fill_null(column, 0).to_numpy().astype(np.uint64)
    close = np.zeros(len(values), bool)
    for start in range(0, len(near), 1024):  # bounded: rows x 1024 bits at a time
        xor = values[:, None] ^ near[None, start : start + 1024]
        bits = np.unpackbits(xor.view(np.uint8), axis=1).reshape(len(values), -1, 64).sum(-1)
        close |= (bits <= radius).any(axis=1)
    return scores["key"].filter(pa.array(close & valid))


def blocklist_path(root: Path, source: str) -> Path:
    return root / source / FOLDER / BLOCKLIST


def read_blocklist(root: Path, source: str) -> pa.Table:
    path = blocklist_path(root, source)
    # _block_rows: a blocklist written before `origin` was kept reads with it null
    return _block_rows(pq.read_table(path)) if path.exists() else BLOCK_SCHEMA.empty_table()


def add_to_blocklist(root: Path, source: str, rows: pa.Table) -> int:
    """The removed rows join the data root's blocklist of the source (deduplicated by key, key
    order: the same list twice writes the same file); returns the rows it holds. `rows` may lack
    some of BLOCK_SCHEMA's columns (a plan written before `origin` was kept)."""
    merged = _merge([read_blocklist(root, source), _block_rows(rows)])
    before = read_blocklist(root, source)
    if before.num_rows == merged.num_rows and before.equals(merged):
        return merged.num_rows
    with atomic_path(blocklist_path(root, source)) as tmp:
        pq.write_table(merged, tmp)
    return merged.num_rows


def blocked_rows(table: pa.Table, blocked: pa.Table) -> np.ndarray:
    """Which metadata rows the data root's blocklist names, by URL or hash (content, not
    position: keys follow the upstream files' order, which a later release may change)."""
    urls = pc.unique(pc.drop_null(blocked["url"]))
    hashes = pc.unique(pc.drop_null(blocked["hash"]))
    hit = pc.fill_null(pc.is_in(table["url"], value_set=urls), False)
    if "hash" in table.column_names and len(hashes):
        hit = pc.or_(hit, pc.fill_null(pc.is_in(table["hash"], value_set=hashes), False))
    return hit.to_numpy(zero_copy_only=False)


def blocked_values(root: Path, source: str, column: str) -> pa.Array:
    """The distinct non-null values of one column of the source's blocklist."""
    return pc.unique(pc.drop_null(read_blocklist(root, source)[column]).combine_chunks())
