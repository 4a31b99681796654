"""Archive and folder sources: one small interface, one index stage, one repack stage.

An adapter knows one upstream layout and answers one question: what samples are there
(`Adapter.entries`: an image's origin, its caption, source extras, an optional crop box).
Everything else is shared, so every source gets the same shards, tables and drop reasons:

- index (stage `metadata`, one unit): the entries -> the normalized sample table
  `metadata/NNNNN.parquet`, `samples_per_shard` rows each, keys `<shard><row:07d>`; an entry
  the adapter refused, an unsafe archive path or a bad caption is counted under its reason.
- repack (stage `shards`, one unit per shard): the shard's images are read (an archive once
  per shard; a remote one is first copied under `<root>/<source>/raw/`), decoded by the rules
  of `tasks.latents.images`, cropped (a crop box the adapter gives), resized down to at most the
  source's resolution on the short side with the aspect ratio kept, and written as JPEG into
  `shards/NNNNN.tar` (key.jpg, key.txt, key.json), with the sample table
  `shards/NNNNN.parquet` (status `success` or the reason the image was dropped).
- a row a removal took out (`<root>/<source>/removals/blocklist.parquet`) is dropped as
  `removed` at index by its origin (after keys are given: the others keep theirs) and at
  repack by the sha256 of its bytes (the same image at another origin).

An origin is `<archive>::<member>` for an image inside an archive, or a file path; both are
relative to the source's location, which is read through fsspec (local folder, https://,
hf://datasets/..., with the catalog's revision pinned).
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import threading
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from catalog import FilterProfile, Source
from sdtrain.atomic import atomic_path
from tasks.latents import images
from tasks.latents.tokenize import clean_caption
from tasks.removal import lists
from tasks.runtime.shards import ShardStats, run_shard, shard_name, stats_path
from tasks.sources.table import SourceError, write_table

ALL = "all"
SEP = "::"
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
SAMPLE_COLUMNS = ("key", "source", "caption", "origin")


class SourceLayoutError(SourceError):
    """The source's location lacks what its adapter needs (says what is missing, and where)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One sample an adapter found: where its image is, its caption, source extras."""

    origin: str
    caption: str | bytes | None
    extras: dict = field(default_factory=dict)
    crop: tuple[int, int, int, int] | None = None  # x, y, w, h in stored pixels


@dataclass(frozen=True, slots=True)
class Refused:
    """A sample the adapter found but cannot use: counted under `reason`."""

    origin: str
    reason: str


class Adapter:
    """One upstream layout. Subclasses set `extras` (column name -> arrow type of the source
    columns they keep) and implement `entries`, in a stable order."""

    extras: dict[str, pa.DataType] = {}

    def __init__(self, source: Source, profile: FilterProfile):
        self.source = source
        self.profile = profile
        self.location = located(source)
        self.fs, self.base = fsspec.core.url_to_fs(self.location)

    def entries(self) -> Iterator[Entry | Refused]:
        raise NotImplementedError

    # helpers for subclasses
    def path(self, relative: str) -> str:
        return f"{self.base.rstrip('/')}/{relative}" if relative else self.base

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self.path(relative))

    def open(self, relative: str, mode: str = "rb"):
        return self.fs.open(self.path(relative), mode)

    def require(self, *relatives: str) -> None:
        """Fail in one line naming what is missing under the location."""
        missing = [r for r in relatives if not self.exists(r)]
        if missing:
            raise SourceLayoutError(
                f"source {self.source.name!r}: {', '.join(missing)} not found under {self.location}"
            )


def located(source: Source) -> str:
    """The source's location with the catalog's revision pinned where the upstream has one."""
    location = source.location
    if location.startswith("hf://datasets/") and source.revision and "@" not in location:
        owner, name, *rest = location.removeprefix("hf://datasets/").split("/")
        location = f"hf://datasets/{owner}/{name}@{source.revision}/" + "/".join(rest)
    return location.rstrip("/")


def unsafe(path: str) -> bool:
    """An archive member or file path that could point outside its folder."""
    p = PurePosixPath(path.replace("\\", "/"))
    return p.is_absolute() or ".." in p.parts or (len(path) > 1 and path[1] == ":")


def split_origin(origin: str) -> tuple[str, str]:
    """(archive, member) of an archive origin; ("", path) of a file origin."""
    archive, sep, member = origin.partition(SEP)
    return (archive, member) if sep else ("", origin)


# ---- index ------------------------------------------------------------------------------------


def index_source(root: Path, source: Source, adapter: Adapter) -> ShardStats:
    """The adapter's entries -> `metadata/NNNNN.parquet` sample-table shards (one unit)."""
    out_dir = root / source.name / "metadata"

    def work(stats: ShardStats) -> None:
        rows: list[dict] = []
        for entry in adapter.entries():
            stats.num_in += 1
            if isinstance(entry, Refused):
                stats.drop(entry.reason)
                continue
            if any(unsafe(part) for part in split_origin(entry.origin) if part):
                stats.drop("unsafe_path")
                continue
            caption, reason = clean_caption(entry.caption)
            if reason:
                stats.drop(reason)
                continue
            rows.append(
                {
                    "caption": caption,
                    "origin": entry.origin,
                    **entry.extras,
                    "crop": list(entry.crop) if entry.crop else None,
                }
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("[0-9]*.parquet"):
            old.unlink()
        per_shard = source.samples_per_shard
        num_shards = 0
        # Rows a removal took out (`sdpipe remove`) go after their keys are given, so every other
        # row keeps the key it had in the build the removal rewrote.
        taken_back = lists.blocked_values(root, source.name, "origin")
        num_out = 0
        for start in range(0, len(rows), per_shard):
            shard = shard_name(num_shards)
            table = sample_table(source, adapter, shard, rows[start : start + per_shard])
            gone = pc.is_in(table["origin"], value_set=taken_back)
            if len(taken_back) and (removed := pc.sum(gone).as_py()):
                stats.drop("removed", removed)
                table = table.filter(pc.invert(gone))
            with atomic_path(out_dir / f"{shard}.parquet") as tmp:
                write_table(table, tmp)
            num_out += table.num_rows
            num_shards += 1
        stats.num_out = num_out
        stats.extra = {"num_shards": num_shards, "location": adapter.location}

    return run_shard(root, source.name, "metadata", ALL, work)


def sample_table(source: Source, adapter: Adapter, shard: str, rows: list[dict]) -> pa.Table:
    n = len(rows)
    columns = {
        "key": pa.array([f"{shard}{i:07d}" for i in range(n)], pa.string()),
        "source": pa.array([source.name] * n, pa.string()),
        "caption": pa.array([r["caption"] for r in rows], pa.string()),
        "origin": pa.array([r["origin"] for r in rows], pa.string()),
        "crop": pa.array([r["crop"] for r in rows], pa.list_(pa.int64(), 4)),
    }
    for name, dtype in adapter.extras.items():
        columns[name] = pa.array([r.get(name) for r in rows], dtype)
    return pa.table(columns)


def shard_names(root: Path, source: str) -> list[str]:
    return sorted(p.stem for p in (root / source / "metadata").glob("[0-9]*.parquet"))


# ---- read -------------------------------------------------------------------------------------


def fetch_archive(root: Path, adapter: Adapter, archive: str) -> tuple[Path, bool]:
    """(local path of an archive, whether it is a copy under raw/ that may be removed)."""
    if isinstance(adapter.fs, LocalFileSystem):
        return Path(adapter.path(archive)), False
    local = root / adapter.source.name / "raw" / archive
    with _RAW_LOCK:  # shards run in threads and may share one archive (COCO's train2017.zip)
        _RAW_USERS[local] = _RAW_USERS.get(local, 0) + 1
        fetching = _RAW_FETCHING.setdefault(local, threading.Lock())
    try:
        with fetching:  # one copy at a time: the others wait for it, then use it
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(local) as tmp:
                    adapter.fs.get_file(adapter.path(archive), str(tmp))
    except BaseException:
        release_archive(local, remove=False)
        raise
    return local, True


_RAW_LOCK = threading.Lock()
_RAW_USERS: dict[Path, int] = {}
_RAW_FETCHING: dict[Path, threading.Lock] = {}


def release_archive(
    local: Path, *, remove: bool, reader: tuple[Path, str, str, str] | None = None
) -> None:
    """A shard is done with a copy from `fetch_archive`. With `remove`, the last user in this
    process removes it (never while another thread still reads it) unless, with `reader`
    (root, source, archive, shard), a shard that has not read it yet will need it. The
    decision is taken under the lock, by the last user, with what every reader had done."""
    with _RAW_LOCK:
        if reader is not None:
            root, source, archive, shard = reader
            _READERS.setdefault((str(root), source, archive), set()).add(shard)
        _RAW_USERS[local] -= 1
        if _RAW_USERS[local] <= 0:
            del _RAW_USERS[local]
            if remove and not (reader is not None and _needed_later(*reader)):
                local.unlink(missing_ok=True)


def read_zip(path: Path, members: list[str]) -> Iterator[tuple[str, bytes | str]]:
    """(member, bytes or drop reason) for each wanted member of a zip."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError):
        for m in members:
            yield m, "truncated_archive"
        return
    with zf:
        names = set(zf.namelist())
        for m in members:
            if m not in names:
                yield m, "missing_image"
                continue
            try:
                yield m, zf.read(m)
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError):
                yield m, "truncated_archive"  # bad CRC, cut-off data


def read_tar(path: Path, members: list[str]) -> Iterator[tuple[str, bytes | str]]:
    """(member, bytes or drop reason) for each wanted member of a (compressed) tar, streamed
    in one pass; members after a point where the archive is cut off are `truncated_archive`."""
    wanted = set(members)
    found: dict[str, bytes] = {}
    broken = False
    try:
        with tarfile.open(path, "r|*") as tar:
            for info in tar:
                name = info.name.removeprefix("./")
                if name in wanted and info.isfile():
                    found[name] = tar.extractfile(info).read()
                    if len(found) == len(wanted):
                        break
    except (tarfile.TarError, EOFError, zlib.error, OSError):
        broken = True
    for m in members:
        if m in found:
            yield m, found.pop(m)
        else:
            yield m, "truncated_archive" if broken else "missing_image"


def iter_origins(
    root: Path, adapter: Adapter, origins: list[str], *, shard: str | None = None
) -> Iterator[tuple[str, bytes | str]]:
    """(origin, bytes or drop reason) for every origin, archive by archive (each opened once).

    A remote archive's copy under raw/ is removed after use unless the source option
    `keep_raw` is set or (reading for `shard`) another shard will still read it."""
    by_archive: dict[str, list[str]] = {}
    for origin in origins:
        archive, member = split_origin(origin)
        by_archive.setdefault(archive, []).append(member)
    for archive, members in by_archive.items():
        if not archive:
            for m in members:
                try:
                    with adapter.open(m) as f:
                        yield m, f.read()
                except (FileNotFoundError, IsADirectoryError):
                    yield m, "missing_image"
            continue
        try:
            path, copied = fetch_archive(root, adapter, archive)
        except FileNotFoundError:
            for m in members:
                yield f"{archive}{SEP}{m}", "missing_archive"
            continue
        reader = read_zip if archive.lower().endswith(".zip") else read_tar
        try:
            for m, v in reader(path, members):
                yield f"{archive}{SEP}{m}", v
        finally:
            if copied:
                release_archive(
                    path,
                    remove=not adapter.source.options.get("keep_raw", False),
                    reader=(root, adapter.source.name, archive, shard) if shard else None,
                )


def read_origins(root: Path, adapter: Adapter, origins: list[str]) -> dict[str, bytes | str]:
    """Every origin's bytes or drop reason (all in memory: for small sets)."""
    return dict(iter_origins(root, adapter, origins))


_READERS: dict[tuple[str, str, str], set[str]] = {}  # (root, source, archive) -> shards
# (root, source) -> (the index record's version, archive -> the shards with an origin in it)
_ARCHIVE_SHARDS: dict[tuple[str, str], tuple[tuple, dict[str, set[str]]]] = {}


def _archive_shards(root: Path, source: str) -> dict[str, set[str]]:
    """archive -> the metadata shards that read from it. Read once per index run (keyed by its
    record): a check that reads every shard each time an archive is released reads shards^2."""
    record = stats_path(root, source, "metadata", ALL)
    stat = record.stat() if record.exists() else None
    version = (stat.st_ino, stat.st_mtime_ns, stat.st_size) if stat else None
    cached = _ARCHIVE_SHARDS.get((str(root), source))
    if version is not None and cached is not None and cached[0] == version:
        return cached[1]
    readers: dict[str, set[str]] = {}
    for path in sorted((root / source / "metadata").glob("[0-9]*.parquet")):
        origins = pq.read_table(path, columns=["origin"])["origin"]
        inside = pc.filter(origins, pc.match_substring(origins, SEP))
        archives = pc.list_element(pc.split_pattern(inside, SEP, max_splits=1), 0)
        for archive in pc.unique(archives).to_pylist():
            readers.setdefault(archive, set()).add(path.stem)
    if version is not None:
        _ARCHIVE_SHARDS[(str(root), source)] = (version, readers)
    return readers


def _needed_later(root: Path, source: str, archive: str, shard: str) -> bool:
    """Whether a shard of `source` that has not read `archive` (in this process) and is not
    done will read it. Called with _RAW_LOCK held."""
    done_reading = _READERS.get((str(root), source, archive), set()) | {shard}
    return any(
        other not in done_reading and not stats_path(root, source, "shards", other).exists()
        for other in _archive_shards(root, source).get(archive, ())
    )


# ---- repack -----------------------------------------------------------------------------------


def repack_shard(
    root: Path,
    source: Source,
    adapter: Adapter,
    shard: str,
    *,
    pool: images.DecodePool | None = None,
    chunk: int = 32,
    in_flight: int = 4,
) -> ShardStats:
    """One shard's images -> `shards/NNNNN.tar` + its sample table `shards/NNNNN.parquet`.

    Images stream through: an archive's members are read, handed to the decode workers in
    chunks (`images.repack_stream`) and written to the tar as they come back, so memory holds a
    few chunks, not the shard.
    """
    table_path = root / source.name / "metadata" / f"{shard}.parquet"
    out_dir = root / source.name / "shards"
    size, min_side = source.resolution, adapter.profile.min_side

    def work(stats: ShardStats) -> None:
        table = pq.read_table(table_path)
        rows = table.to_pylist()
        taken_back = set(lists.blocked_values(root, source.name, "sha256").to_pylist())
        stats.num_in = len(rows)
        index = {r["origin"]: i for i, r in enumerate(rows)}
        status: list[str] = ["success"] * len(rows)
        width: list[int | None] = [None] * len(rows)
        height: list[int | None] = [None] * len(rows)
        sha: list[str | None] = [None] * len(rows)
        out_dir.mkdir(parents=True, exist_ok=True)

        def items() -> Iterator[tuple[int, bytes, tuple | None]]:
            origins = [r["origin"] for r in rows]
            for origin, data in iter_origins(root, adapter, origins, shard=shard):
                i = index[origin]
                if isinstance(data, str):
                    status[i] = data
                    continue
                sha[i] = hashlib.sha256(data).hexdigest()
                if sha[i] in taken_back:  # a removed image, at this origin or another
                    status[i] = "removed"
                    continue
                crop = rows[i]["crop"]
                yield i, data, tuple(crop) if crop else None

        with atomic_path(out_dir / f"{shard}.tar") as tmp, tarfile.open(tmp, "w") as tar:
            repacked = images.repack_stream(
                pool or images.shared_pool(),
                items(),
                size,
                min_side=min_side,
                chunk=chunk,
                in_flight=in_flight,
            )
            for i, result in repacked:
                if isinstance(result, str):
                    status[i] = result
                    continue
                jpeg, width[i], height[i] = result
                r = rows[i]
                meta = {k: v for k, v in r.items() if k != "crop"}
                meta.update(width=width[i], height=height[i], sha256=sha[i])
                images.write_sample(tar, r["key"], jpeg, r["caption"], meta)
        for i, s in enumerate(status):
            if s != "success":
                width[i] = height[i] = None
        out = (
            table.drop_columns(["crop"])
            .append_column("width", pa.array(width, pa.int64()))
            .append_column("height", pa.array(height, pa.int64()))
            .append_column("sha256", pa.array(sha, pa.string()))
            .append_column("status", pa.array(status, pa.string()))
        )
        if "removed" in status:  # counted below; its caption is not kept
            out = out.filter(pc.not_equal(out["status"], "removed"))
        with atomic_path(out_dir / f"{shard}.parquet") as tmp:
            pq.write_table(out, tmp)
        for s in status:
            if s != "success":
                stats.drop(s)
        stats.num_out = status.count("success")

    return run_shard(root, source.name, "shards", shard, work)


def remove_raw(root: Path, source: str) -> None:
    """Remove the copies of remote archives (kept only with the source option `keep_raw`)."""
    shutil.rmtree(root / source / "raw", ignore_errors=True)
