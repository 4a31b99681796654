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
(size, mtime_ns, inode, ctime_ns) (`keys_stat`, `tokens_stat`), taken before its digest, and
`check` trusts a file whose stat is the same and digests only the others, refusing only a digest
that differs. sdpipe rewrites a file by rename (a new inode); an edit in place moves its ctime
even where its mtime is put back (`cp -p`, `touch -r`), and so does a chmod, a hard link or a
rename (a keep-aside, a copied root): those are digested, and pass if their rows are the same.
A stat recorded before ctime was ([size, mtime_ns, inode]) is compared on those three. Sets
mixed without stats are digested.

The latents and token-id `.npy` files are mapped lazily, long after `check`: mix records their
stats too (`MAPPED`), and `MapCheck` compares the descriptor mapped (`os.fstat`) with them; one
that differs passes only while its shard's keys and tokens still digest as recorded (their
values are not digested: a shard's latents are gigabytes).
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

from sdtrain import layout
from sdtrain.layout import BUCKET_FILE, FILES

# In files.json: {"<source>-<shard>": {"keys": digest, "tokens": digest, "keys_stat": stat,
# "tokens_stat": stat}}, a stat [size, mtime_ns, inode, ctime_ns] (before ctime was recorded:
# the first three) or None (no file).
FIELD = "sources"
KINDS = ("keys", "tokens")
KEYS_SUFFIX = ".keys.arrow"
KEY_COLUMNS = ("key", "token_row", "bucket", "bucket_row")
# The stats of the files the set maps, uint64 [files, 2, 4]: row f = files.json's file f's
# latents and token ids (their folder in the set, by kind), a stat as above; zeros: no file.
# Binary, not in files.json: a bucketed set of 10,000 shards has 200,000 files.
MAPPED = "mapped_stats.npy"
MAPPED_KINDS = {"latents": "latents", "ids": "tokens"}


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


def stat_fields(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def file_stat(path: Path) -> list[int] | None:
    """[size, mtime_ns, inode, ctime_ns] of the file a path (or the link it is) names; None if
    none."""
    try:
        return stat_fields(os.stat(path))
    except FileNotFoundError:
        return None


def same_stat(recorded: list[int] | None, current: list[int] | None) -> bool:
    """Whether a file is the one recorded: a record without ctime (an older sdpipe's) is compared
    on the fields it has."""
    return recorded is not None and current is not None and current[: len(recorded)] == recorded


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
    `files.json`; the stats of the files it maps are written to `MAPPED` in `phase_dir`."""
    mapped = np.zeros((len(names), len(MAPPED_KINDS), 4), np.uint64)

    def stat_file(f: int) -> None:
        for k, folder in enumerate(MAPPED_KINDS.values()):
            if (stat := file_stat(phase_dir / folder / f"{names[f]}.npy")) is not None:
                mapped[f, k] = _unsigned(stat)

    pairs = _sources(phase_dir, names)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(stat_file, range(len(names))))  # before the digests: a later change shows
        np.save(phase_dir / MAPPED, mapped)
        return dict(zip(pairs, pool.map(_record, pairs.values()), strict=True))


def _changed(pair: tuple[Path, Path], recorded: dict) -> tuple[list[str], list]:
    """(the kinds of the shard's files whose rows moved, their stats as seen before): a file
    whose stat is the one recorded is trusted; any other is digested, and changed only if its
    digest is another (a file now missing is left to the set's reader)."""
    changed, seen = [], []
    for kind, path in zip(KINDS, pair, strict=True):
        seen.append(file_stat(path))
        if same_stat(recorded.get(f"{kind}_stat"), seen[-1]):
            continue
        if DIGESTS[kind](path) not in (None, recorded.get(kind)):
            changed.append(kind)
    return changed, seen


def check(phase_dir: Path, threads: int = 8) -> MapCheck | None:
    """StalePhaseSet naming the first changed file (and how many more) unless every shard's
    files are as mix recorded them (`_changed`). A set mixed before digests were recorded
    passes. Returns the check of the files the set maps later (None: a set without records)."""
    phase_dir = Path(phase_dir)
    try:
        meta = json.loads((phase_dir / FILES).read_text())
    except FileNotFoundError:
        return None
    recorded = meta.get(FIELD)
    if not recorded:
        return None
    pairs = _sources(phase_dir, [f["name"] for f in meta["files"]])
    shards = [shard for shard in recorded if shard in pairs]
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda shard: _changed(pairs[shard], recorded[shard]), shards))
    stale = [
        (pairs[shard][0] if kind == "keys" else pairs[shard][1].resolve(), kind)
        for shard, (kinds, _) in zip(shards, results, strict=True)
        for kind in kinds
    ]
    if stale:
        raise stale_error(phase_dir, stale)
    seen = {shard: stats for shard, (_, stats) in zip(shards, results, strict=True)}
    return MapCheck(phase_dir, recorded, seen, [f["name"] for f in meta["files"]])


def stale_error(phase_dir: Path, stale: list[tuple[Path, str]], when: str = "") -> StalePhaseSet:
    path, kind = stale[0]
    what = "re-encoded or refetched" if kind == "keys" else "re-tokenized or refetched"
    more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
    runs = phase_dir.parent.parent / "runs" / phase_dir.name / "checkpoints"
    return StalePhaseSet(
        f"phase set {phase_dir}: {path}{more} changed since the set was mixed (its source was "
        f"{what}{when}): its rows would read other samples' latents or captions. Rebuild the "
        f"phase set: restore the source's files, or start the phase over (move {runs} away, "
        "then run the phase again, which mixes it anew)"
    )


class MapCheck:
    """The check of a set's latents and token-id files as they are mapped (`sdtrain.data`
    maps them on first read, after `check`): the stat of the descriptor mapped against mix's
    record (`MAPPED`, itself mapped: every rank of a machine shares one copy). One that differs
    (a rewrite since, or a chmod, link or copy) passes only while its shard's keys and tokens
    files digest as recorded; their stats then are remembered, so a shard's other files, and a
    file mapped again, cost a stat each, not a digest."""

    def __init__(
        self, phase_dir: Path, recorded: dict[str, dict], seen: dict[str, list], files: list[str]
    ):
        self.phase_dir = phase_dir
        self.digests = {shard: {k: r.get(k) for k in KINDS} for shard, r in recorded.items()}
        self.verified = seen  # shard -> [keys stat, tokens stat] last found to digest as recorded
        self.files = files  # files.json's, the order of `MAPPED`'s rows
        self.names: list[str] = []
        self.stats: np.ndarray | None = None

    def bind(self, names: list[str]) -> MapCheck:
        """The record of the files named, in that order (the set's reader's): `MAPPED`'s rows,
        or (an index derived from a manifest rewritten since) those rows found by name; none for
        a set mixed before it."""
        self.names = names
        try:
            stats = layout.map_npy(self.phase_dir / MAPPED)
        except FileNotFoundError:
            stats = None
        if stats is not None and stats.shape != (len(self.files), len(MAPPED_KINDS), 4):
            stats = None
        if stats is not None and names != self.files:
            at = {name: f for f, name in enumerate(self.files)}
            rows = np.array([at.get(name, -1) for name in names], np.int64)
            stats = np.where((rows >= 0)[:, None, None], stats[rows], 0).astype(np.uint64)
        self.stats, self.files = stats, []
        return self

    def latents(self, f: int, st: os.stat_result) -> None:
        self._mapped("latents", f, st)

    def ids(self, f: int, st: os.stat_result) -> None:
        self._mapped("ids", f, st)

    def _mapped(self, kind: str, f: int, st: os.stat_result) -> None:
        """StalePhaseSet when file `f` mapped (`st`: its descriptor's stat) is not the one mix
        recorded and its shard's keys or tokens no longer digest as recorded."""
        if self.stats is None:
            return
        recorded = self.stats[f, list(MAPPED_KINDS).index(kind)].tolist()
        if not any(recorded) or recorded == _unsigned(stat_fields(st)):  # zeros: no record
            return
        name = self.names[f]
        shard = shard_of(name)
        pair = (keys_path(self.phase_dir, name), self.phase_dir / "tokens" / f"{name}.parquet")
        seen = [file_stat(path) for path in pair]  # before the digests, as at open
        if seen == self.verified.get(shard):
            return
        digests = self.digests.get(shard, {})
        stale = [
            (path if source == "keys" else path.resolve(), source)
            for source, path in zip(KINDS, pair, strict=True)
            if DIGESTS[source](path) not in (None, digests.get(source))
        ]
        if stale:
            mapped = f"{MAPPED_KINDS[kind]}/{name}.npy"
            raise stale_error(self.phase_dir, stale, f"; found when mapping {mapped}")
        self.verified[shard] = seen


def _unsigned(stat: list[int]) -> list[int]:
    """A stat's fields as uint64 holds them (an inode may pass 2^63, an mtime be negative)."""
    return [v % (1 << 64) for v in stat]
