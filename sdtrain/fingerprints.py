"""Whether a phase set still lines up with the source files it links (`files.json` "sources").

A phase set's rows point into its sources' files by position: `latent_row` into a shard's
latents (through its keys file's `bucket`, `bucket_row` in the bucketed layout) and `token_row`
into its tokens. A refetch, re-tokenize or re-encode writes the same file names with rows in
other positions, and a set mixed before would read other samples' latents or captions. So mix
records, per shard it links (`<source>-<shard>`), a digest of what fixes those positions:

- `keys`: the keys file beside the linked latents (`<shard>.keys.arrow`): columns `key`,
  `token_row` and, in the bucketed layout, `bucket` and `bucket_row`; None when the shard had
  no keys file (keys in its stats record, an older sdpipe: a keys file there now is a change);
- `tokens`: the `key` column of the linked `tokens/<file>.parquet`.

`check` refuses a set whose sources changed, naming the file. A digest is blake2b over the
columns' Arrow buffers (string offsets rebased to 0): no Python object per row; the keys file
is memory-mapped, the tokens file's key column alone is read. The keys file is found from the
latents link's target, so a set whose latents were kept aside under their spec's folder
(`tasks.latents.kept_latents`) is checked against the keys kept with them.

Every rank opens the set, and a digest costs ~1 s per 1M rows: so mix also records each file's
(size, mtime_ns, inode) (`keys_stat`, `tokens_stat`), taken before its digest, and `check`
trusts a file whose stat is the same and digests only the others, refusing only a digest that
differs (a file touched but the same passes). sdpipe rewrites a file by rename (a new inode),
and an edit in place moves its mtime. Sets mixed without stats are digested whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.layout import BUCKET_FILE, FILES

# In files.json: {"<source>-<shard>": {"keys": digest, "tokens": digest, "keys_stat": stat,
# "tokens_stat": stat}}, a stat [size, mtime_ns, inode] or None (no file).
FIELD = "sources"
KINDS = ("keys", "tokens")
KEYS_SUFFIX = ".keys.arrow"
KEY_COLUMNS = ("key", "token_row", "bucket", "bucket_row")


class StalePhaseSet(ValueError):
    """A phase set's source files changed since it was mixed: its rows would read other samples."""


def column_digest(table: pa.Table, columns: tuple[str, ...]) -> str:
    """blake2b of the named columns present (strings: rebased offsets + bytes; ints as int64)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(table.num_rows).encode())
    for name in columns:
        if name not in table.column_names:
            continue
        h.update(name.encode())
        column = table[name].combine_chunks()
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            width = np.int32 if pa.types.is_string(column.type) else np.int64
            buffers = column.buffers()
            first = column.offset
            offsets = np.frombuffer(buffers[1], width)[first : first + len(column) + 1]
            start, end = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
            h.update((offsets.astype(np.int64) - start).tobytes())
            if buffers[2] is not None:
                h.update(memoryview(buffers[2])[start:end])
        else:
            h.update(column.to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    return h.hexdigest()


def keys_digest(path: Path) -> str | None:
    """Digest of a keys file's position columns (memory-mapped), None when there is none."""
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except FileNotFoundError:
        return None
    return column_digest(table, KEY_COLUMNS)


def tokens_digest(path: Path) -> str | None:
    """Digest of a tokens file's `key` column, None when there is none."""
    try:
        return column_digest(pq.read_table(path, columns=["key"]), ("key",))
    except FileNotFoundError:
        return None


DIGESTS = {"keys": keys_digest, "tokens": tokens_digest}


def file_stat(path: Path) -> list[int] | None:
    """[size, mtime_ns, inode] of the file a path (or the link it is) names; None if none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def shard_of(file_name: str) -> str:
    """`<source>-<shard>` of a phase-set file (`<source>-<shard>` or `<source>-<shard>.<WxH>`)."""
    return BUCKET_FILE.sub("", file_name)


def keys_path(phase_dir: Path, file_name: str) -> Path:
    """The keys file beside the latents a phase-set file links: `<dir>/<shard>.keys.arrow`."""
    target = Path(os.path.realpath(phase_dir / "latents" / f"{file_name}.npy"))
    return target.parent / f"{target.name.split('.')[0]}{KEYS_SUFFIX}"


def _sources(phase_dir: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """(keys file, tokens file) of each shard the set links, by its first file."""
    found: dict[str, tuple[Path, Path]] = {}
    for name in names:
        shard = shard_of(name)
        if shard not in found:
            found[shard] = (keys_path(phase_dir, name), phase_dir / "tokens" / f"{name}.parquet")
    return found


def _record(pair: tuple[Path, Path]) -> dict:
    out: dict = {}
    for kind, path in zip(KINDS, pair, strict=True):
        out[f"{kind}_stat"] = file_stat(path)  # before the digest: a later change is not trusted
        out[kind] = DIGESTS[kind](path)
    return out


def record(phase_dir: Path, names: list[str], threads: int = 8) -> dict[str, dict]:
    """The digests and stats of every shard a phase set (links already made) reads, for
    `files.json`."""
    pairs = _sources(phase_dir, names)
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(pairs, pool.map(_record, pairs.values()), strict=True))


def _changed(pair: tuple[Path, Path], recorded: dict) -> list[str]:
    """The kinds of the shard's files whose rows moved: a file whose stat is the one recorded
    is trusted; any other is digested, and changed only if its digest is another (a file now
    missing is left to the set's reader)."""
    changed = []
    for kind, path in zip(KINDS, pair, strict=True):
        stat = recorded.get(f"{kind}_stat")
        if stat is not None and file_stat(path) == stat:
            continue
        if DIGESTS[kind](path) not in (None, recorded.get(kind)):
            changed.append(kind)
    return changed


def check(phase_dir: Path, threads: int = 8) -> None:
    """StalePhaseSet naming the first changed file (and how many more) unless every shard's
    files are as mix recorded them (`_changed`). A set mixed before digests were recorded
    passes."""
    phase_dir = Path(phase_dir)
    try:
        meta = json.loads((phase_dir / FILES).read_text())
    except FileNotFoundError:
        return
    recorded = meta.get(FIELD)
    if not recorded:
        return
    pairs = _sources(phase_dir, [f["name"] for f in meta["files"]])
    shards = [shard for shard in recorded if shard in pairs]
    with ThreadPoolExecutor(threads) as pool:
        changed = pool.map(lambda shard: _changed(pairs[shard], recorded[shard]), shards)
        stale = [
            (pairs[shard][0] if kind == "keys" else pairs[shard][1].resolve(), kind)
            for shard, kinds in zip(shards, changed, strict=True)
            for kind in kinds
        ]
    if not stale:
        return
    path, kind = stale[0]
    what = "re-encoded or refetched" if kind == "keys" else "re-tokenized or refetched"
    more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
    runs = phase_dir.parent.parent / "runs" / phase_dir.name / "checkpoints"
    raise StalePhaseSet(
        f"phase set {phase_dir}: {path}{more} changed since the set was mixed (its source was "
        f"{what}): its rows would read other samples' latents or captions. Rebuild the phase "
        f"set: restore the source's files, or start the phase over (move {runs} away, then "
        "run the phase again, which mixes it anew)"
    )
