"""fetch-images: one filtered URL shard -> img2dataset -> `shards/NNNNN.tar` + sample table.

img2dataset only downloads (`disable_all_reencoding`: it keeps each image's bytes as served);
the images then go through sdpipe's own decode workers (`tasks.latents.images`), the one rule set of
every source: EXIF orientation, 16-bit, alpha, CMYK, bombs (`too_large`), truncation, the size
floor, the resize (down to a short side of at most `image_size`, aspect ratio kept), JPEG.
Its status parquet becomes the shard's sample table, with every failure mapped to a named
drop reason.

Downloads run on the node's fetch pool (`FetchPool`): long-lived child processes that import
img2dataset once and run its shard downloader (`img2dataset.downloader.Downloader`, what its
own distributor runs in each of its processes) with many threads, sized by
`concurrency.fetch_parallelism` (one process per core, 64 threads each, by default). A shard
is split into pieces (`piece_rows`) that the pool downloads in parallel; each piece's images
are decoded as soon as that piece is done, while the next ones download. So the stage pays
img2dataset's start-up (~3 CPU-s per process: it imports torch through webdataset) once per
process, not three times per shard (`img2dataset.download` spawns a logger and a pool process
per call, each importing it again), and decoding overlaps downloading.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sdtrain.atomic import atomic_path
from tasks.latents import images
from tasks.runtime import concurrency
from tasks.runtime.lanes import Lanes
from tasks.runtime.net import python_path
from tasks.runtime.node import Node, Slots, local_node
from tasks.runtime.shards import ShardStats, bump_generation, run_shard, stats_path, write_record
from tasks.sources import bounded_download
from tasks.sources.bounded_download import fetch_limits

STAGE = "shards"
KEY_COLUMN = "sdpipe_key"
# img2dataset's input columns, in the order its reader gives them to its downloader.
COLUMNS = [KEY_COLUMN, "caption", "url"]
# A piece is at most this many rounds of a process's threads: short enough that the first
# images reach the decoders early, long enough that a piece's tail (threads idle while its
# last requests finish) is a small part of it.
PIECE_ROUNDS = 8
# What img2dataset.download honours by default (X-Robots-Tag opt-outs).
DISALLOWED_HEADER_DIRECTIVES = ["noai", "noimageai", "noindex", "noimageindex"]


def drop_reason(error_message: str | None) -> str:
    """img2dataset's free-text error -> a drop reason users can count and search for."""
    msg = (error_message or "").lower()
    if msg.startswith("private host:"):  # the source's rule, at connect (bounded_download)
        return "private_host"
    if m := re.search(r"http error (\d{3})", msg):
        return f"http_{m.group(1)}"
    if "too small" in msg:
        return "too_small"
    if "decoding error" in msg or "cannot identify" in msg:
        return "decode_error"
    if "x-robots-tag" in msg:
        return "robots_optout"
    if "too large" in msg:  # the byte cap (bounded_download)
        return "too_large"
    if "timed out" in msg or "timeout" in msg:
        return "timeout"
    if "hash mismatch" in msg:
        return "hash_mismatch"
    return "fetch_error"


class FetchFailed(Exception):
    """img2dataset itself failed (not one URL: the whole shard)."""


def parallelism(thread_count: int | None = None, budget: int | None = None) -> tuple[int, int]:
    """(downloader processes of the node, threads per process): `concurrency`'s setting for
    the node's `budget` (default: this process's), the threads overridden by a task's
    `thread_count`."""
    processes, threads = concurrency.fetch_parallelism(budget)
    return processes, thread_count or threads


def piece_rows(num_rows: int, processes: int, threads: int) -> int:
    """Rows per piece of a shard: at most PIECE_ROUNDS rounds of a process's threads, and
    enough pieces (each at least a round) that one shard alone keeps every process busy."""
    if num_rows == 0:
        return 1
    pieces = max(
        math.ceil(num_rows / (PIECE_ROUNDS * threads)),
        min(processes, math.ceil(num_rows / threads)),
    )
    return math.ceil(num_rows / pieces)


# ---- the downloader processes ----------------------------------------------------------------


def serve() -> None:
    """A downloader process: JSON requests on stdin (one line each, run in a thread apiece),
    a JSON reply line per request on stdout. Exits at once when stdin closes (its parent
    finished or died), even mid-download."""
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no update check over the network
    from img2dataset.downloader import Downloader
    from img2dataset.resizer import Resizer
    from img2dataset.writer import WebDatasetSampleWriter

    # The protocol gets a private copy of stdout; fd 1 goes to stderr, so what img2dataset
    # prints cannot corrupt it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    lock = threading.Lock()
    bounded_download.install()  # each download within a wall-clock limit and a byte cap
    resizer = Resizer(
        image_size=0, resize_mode="no", resize_only_if_bigger=False, disable_all_reencoding=True
    )

    def run(request: dict) -> None:
        try:
            Downloader(
                sample_writer_class=WebDatasetSampleWriter,
                resizer=resizer,
                thread_count=request["thread_count"],
                save_caption=True,
                extract_exif=False,  # not kept: the shard's JSON drops it
                output_folder=request["output_folder"],
                column_list=COLUMNS,
                timeout=bounded_download.Limits(
                    request["timeout"],
                    request.get("max_seconds", bounded_download.MAX_SECONDS),
                    request.get("max_bytes", bounded_download.MAX_BYTES),
                    request.get("allow_private_hosts", False),
                ),
                number_sample_per_shard=request["rows"],
                oom_shard_count=5,
                compute_hash="sha256",
                verify_hash_type=None,
                encode_format="jpg",
                retries=request["retries"],
                user_agent_token=None,
                disallowed_header_directives=DISALLOWED_HEADER_DIRECTIVES,
            ).download_shard((request["piece"], request["input"]))
            reply = {"id": request["id"], "error": None}
        except Exception:  # the piece failed (not one URL): the parent retries it once
            reply = {"id": request["id"], "error": traceback.format_exc(limit=3)[-2000:]}
        with lock:
            out.write(json.dumps(reply) + "\n")
            out.flush()

    for line in sys.stdin:
        threading.Thread(target=run, args=(json.loads(line),), daemon=True).start()
    os._exit(0)


class WorkerDied(Exception):
    pass


class _Downloader:
    """One downloader process, one request at a time."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": python_path()}
        env.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tasks.sources.fetch_images"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.next_id = 0

    def call(self, request: dict) -> str | None:
        """The piece downloaded: None, or img2dataset's error."""
        self.next_id += 1
        try:
            self.proc.stdin.write(json.dumps({**request, "id": self.next_id}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise EOFError
            return json.loads(line)["error"]
        except (EOFError, OSError, ValueError) as e:
            self.proc.kill()
            self.proc.wait()
            raise WorkerDied(f"downloader process exited with {self.proc.returncode}") from e

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.wait()


class FetchPool(Lanes):
    """The node's img2dataset downloader processes, fed pieces from one queue (first come,
    first served: a shard's pieces are spread over every process). Each process is started
    at once, so its imports overlap the work of the first shard; it lives for every later
    shard. A piece that fails, or whose process dies, is tried once more (as img2dataset's
    own distributor does), in a new process if it died."""

    def __init__(self, processes: int, slots: Slots | None = None):
        super().__init__(processes, "fetch", eager=True, slots=slots)

    def submit(self, request: dict) -> Future:
        return self._submit(request)

    def _start(self) -> _Downloader:
        return _Downloader()

    def _run(self, worker, request: dict) -> tuple:
        error = None
        for _ in range(2):
            try:
                worker = worker or self._start()
                error = worker.call(request)
            except WorkerDied as e:
                worker, error = None, str(e)
            if error is None:
                return None, worker
        return FetchFailed(f"img2dataset: {error.strip()}"), worker


def fetch_pool(processes: int, node: Node | None = None) -> FetchPool:
    """The node's pool of `processes` downloaders (default: this process's node), kept for
    every later shard."""
    return (node or local_node()).pool("fetch", processes, FetchPool)


class Download:
    """img2dataset over `table`'s rows (url, caption, key) into `workdir`, images kept as
    served, in pieces on the node's fetch pool; `pieces()` yields each piece's (status
    parquet with the sdpipe key in KEY_COLUMN, its tar) in order, as soon as it is done.
    Each download ends within `max_seconds` and `max_bytes` (default: `fetch_limits()`), and
    connects to this machine or a private network only if `allow_private_hosts` (the
    source's rule; every redirect hop is checked). `node`: whose downloaders (default: this
    process's)."""

    def __init__(
        self,
        table: pa.Table,
        workdir: Path,
        *,
        thread_count: int | None = None,
        retries: int = 2,
        timeout: int = 10,
        max_seconds: int | None = None,
        max_bytes: int | None = None,
        allow_private_hosts: bool = False,
        node: Node | None = None,
    ):
        self.node = node = node or local_node()
        limits = fetch_limits()  # each download's: the environment's, else the defaults
        if max_seconds is not None:
            limits["max_seconds"] = max_seconds
        if max_bytes is not None:
            limits["max_bytes"] = max_bytes
        processes, threads = parallelism(thread_count, node.workers)
        rows = piece_rows(table.num_rows, processes, threads)
        inputs, self.out = workdir / "in", workdir / "out"
        inputs.mkdir()
        self.out.mkdir()
        pool = fetch_pool(processes, node)
        rename = table.select(["key", "caption", "url"]).rename_columns(COLUMNS)
        self.futures: list[Future] = []
        for i, first in enumerate(range(0, max(table.num_rows, 1), rows)):
            piece = rename.slice(first, rows)
            path = inputs / f"{i}.feather"
            with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, piece.schema) as w:
                w.write_table(piece)
            request = dict(
                piece=i,
                input=str(path),
                output_folder=str(self.out),
                rows=rows,
                thread_count=threads,
                timeout=timeout,
                retries=retries,
                allow_private_hosts=allow_private_hosts,
                **limits,
            )
            self.futures.append(pool.submit(request))
        self.statuses: list[pa.Table] = []
        self.rows: dict[str, dict] = {}  # status row by sdpipe key, of the pieces read so far

    def pieces(self) -> Iterator[tuple[pa.Table, Path]]:
        for i, future in enumerate(self.futures):
            future.result()
            status = pq.read_table(self.out / f"{i:05d}.parquet")
            self.statuses.append(status)
            self.rows.update((r[KEY_COLUMN], r) for r in status.to_pylist())
            yield status, self.out / f"{i:05d}.tar"

    def status(self) -> pa.Table:
        """Every piece's status rows (after `pieces()` went through them)."""
        return pa.concat_tables(self.statuses)

    def __enter__(self) -> Download:
        return self

    def __exit__(self, *exc) -> None:
        """Cancel the pieces not started; wait for the running ones (they write into
        `workdir`, which the caller removes next)."""
        for f in self.futures:
            f.cancel()
        for f in self.futures:
            if not f.cancelled():
                f.exception()


def _raw_images(download: Download, row_of: dict[str, int]) -> Iterator:
    """(row, bytes, None) of every image img2dataset fetched: piece by piece as each is done,
    in the order of its tar; a piece's tar is removed once read."""
    for status, raw_tar in download.pieces():
        i2d_keys = dict(zip(status["key"].to_pylist(), status[KEY_COLUMN].to_pylist(), strict=True))
        with tarfile.open(raw_tar) as src:
            for member in src:
                name, _, ext = member.name.partition(".")
                if member.isfile() and ext == "jpg":  # the served bytes, whatever their format
                    yield row_of[i2d_keys[name]], src.extractfile(member).read(), None
        raw_tar.unlink()


def repack_fetched(
    tar: tarfile.TarFile,
    rows: pa.Table,
    download: Download,
    *,
    size: int,
    min_side: int,
) -> tuple[pa.Table, list[tuple[str, int | None, int | None]]]:
    """Decode img2dataset's raw images by sdpipe's rules into `tar` (key.jpg/.txt/.json) as
    its pieces come in: (img2dataset's status rows, and per row of `rows` (url, caption, key):
    (status, stored width, stored height))."""
    keys = rows["key"].to_pylist()
    row_of = {k: i for i, k in enumerate(keys)}
    captions = rows["caption"].to_pylist()
    decoded: dict[int, tuple[str, int | None, int | None]] = {}
    results = images.repack_stream(
        images.shared_pool(download.node),
        _raw_images(download, row_of),
        size,
        min_side=min_side,
    )
    for i, result in results:
        if isinstance(result, str):
            decoded[i] = (result, None, None)
            continue
        jpeg, width, height = result
        meta = {k: v for k, v in download.rows[keys[i]].items() if k != KEY_COLUMN}
        meta.update(key=keys[i], width=width, height=height)
        for drop in ("original_width", "original_height", "exif"):
            meta.pop(drop, None)
        images.write_sample(tar, keys[i], jpeg, captions[i] or "", meta)
        decoded[i] = ("success", width, height)
    out = []
    for i, key in enumerate(keys):
        r = download.rows[key]
        if i in decoded:
            out.append(decoded[i])
        elif r["status"] == "success":
            out.append(("success", None, None))
        else:
            out.append((drop_reason(r["error_message"]), None, None))
    return download.status(), out


def fetch_images_shard(
    root: Path,
    source: str,
    shard: str,
    *,
    image_size: int,
    min_side: int,
    node: Node | None = None,
    dropped: Path | None = None,
    **download_options,
) -> ShardStats:
    """Fetch one filtered shard's URLs on `node`'s downloaders and decode workers (default:
    this process's node), less the keys in `dropped` (a `key` parquet: the duplicates that
    semantic dedup found before fetch, counted by its own stage)."""
    filtered = root / source / "filtered" / f"{shard}.parquet"
    out_dir = root / source / STAGE

    def work(stats: ShardStats) -> None:
        table = pq.read_table(filtered)
        if dropped is not None:
            skip = pq.read_table(dropped, columns=["key"])["key"]
            table = table.filter(pc.invert(pc.is_in(table["key"], value_set=skip)))
        stats.num_in = table.num_rows
        with (
            tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{shard}.tmp-") as tmp,
            Download(table, Path(tmp), node=node, **download_options) as download,
            atomic_path(out_dir / f"{shard}.tar") as tar_tmp,
            tarfile.open(tar_tmp, "w") as tar,
        ):
            status, fetched = repack_fetched(
                tar, table, download, size=image_size, min_side=min_side
            )
        samples = _sample_table(table, status, fetched, source)
        with atomic_path(out_dir / f"{shard}.parquet") as tmp_table:
            pq.write_table(samples, tmp_table)
        _count(stats, samples)

    out_dir.mkdir(parents=True, exist_ok=True)
    return run_shard(root, source, STAGE, shard, work)


def _count(stats: ShardStats, samples: pa.Table) -> None:
    """Drops by reason and the number of failed URLs: counts only. The failed URLs themselves
    are the shard's sample table's rows whose status is not "success" (`failed_samples`, what
    `sdpipe refetch` works from); a list in every record, and in the flow that holds the
    records, grows with the data (~5 GB at LAION failure rates)."""
    counts = pc.value_counts(samples["status"]).to_pylist()
    for entry in sorted(counts, key=lambda e: e["values"]):
        if entry["values"] != "success":
            stats.drop(entry["values"], entry["counts"])
    stats.num_out = sum(e["counts"] for e in counts if e["values"] == "success")
    stats.extra = {**stats.extra, "num_failed_urls": samples.num_rows - stats.num_out}


# Failures worth another try by default: the server or the network, not the image.
TRANSIENT = re.compile(r"http_(408|429|5\d\d)|timeout|fetch_error")
# Stages computed from a shard's fetched images, whose records a refetch makes stale.
DOWNSTREAM = ("scores", "tokens", "latents")
DOWNSTREAM_ALL = ("selected", "views")


def failed_samples(root: Path, source: str) -> pa.Table:
    """Every URL whose fetch failed, across the source's shards: shard, key, url, status,
    error_message."""
    parts = []
    for path in sorted((root / source / STAGE).glob("[0-9]*.parquet")):
        t = pq.read_table(path, columns=["key", "url", "status", "error_message"])
        t = t.filter(pc.not_equal(t["status"], "success"))
        parts.append(t.add_column(0, "shard", pa.array([path.stem] * t.num_rows, pa.string())))
    if not parts:
        return pa.table(
            {
                c: pa.array([], pa.string())
                for c in ("shard", "key", "url", "status", "error_message")
            }
        )
    return pa.concat_tables(parts)


def refetch_shard(
    root: Path,
    source: str,
    shard: str,
    *,
    image_size: int,
    min_side: int,
    reasons: re.Pattern | None = TRANSIENT,
    **download_options,
) -> ShardStats | None:
    """Fetch a done shard's failed URLs again (those whose reason matches `reasons`; None: all),
    keeping every image already fetched. The shard's tar, sample table and stats record are
    rewritten (each renamed into place; a rerun after a kill redoes the refetch), and the
    records of the stages computed from the shard are removed, so they run again. Returns the
    new stats, or None when there was nothing to refetch."""
    out_dir = root / source / STAGE
    table_path = out_dir / f"{shard}.parquet"
    record = stats_path(root, source, STAGE, shard)
    if not record.exists():
        raise FetchFailed(f"{source}/{shard}: not fetched yet; run build-latents first")
    samples = pq.read_table(table_path)
    statuses = samples["status"].to_pylist()
    pick = [
        i
        for i, s in enumerate(statuses)
        if s != "success" and (reasons is None or reasons.fullmatch(s))
    ]
    if not pick:
        return None
    retry = samples.take(pick)
    with (
        tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{shard}.tmp-refetch-") as tmp,
        Download(retry, Path(tmp), **download_options) as download,
    ):
        again = set(retry["key"].to_pylist())
        with (
            atomic_path(out_dir / f"{shard}.tar") as tar_tmp,
            tarfile.open(out_dir / f"{shard}.tar") as old,
            tarfile.open(tar_tmp, "w") as new,
        ):
            for member in old:  # what was fetched before stays, byte for byte
                if member.name.partition(".")[0] not in again:
                    new.addfile(member, old.extractfile(member))
            status, fetched = repack_fetched(
                new, retry, download, size=image_size, min_side=min_side
            )
        fresh = _sample_table(retry, status, fetched, source)
    by_key = {k: i for i, k in enumerate(fresh["key"].to_pylist())}
    rows = samples.to_pylist()
    fresh_rows = fresh.to_pylist()
    merged = [fresh_rows[by_key[r["key"]]] if r["key"] in by_key else r for r in rows]
    merged_table = pa.Table.from_pylist(merged, schema=samples.schema)
    stats = ShardStats(stage=STAGE, source=source, shard=shard)
    stats.num_in = samples.num_rows
    _count(stats, merged_table)
    stats.extra["refetched"] = len(pick)
    stats.check_balanced()
    invalidate_downstream(root, source, shard)
    with atomic_path(table_path) as tmp_table:
        pq.write_table(merged_table, tmp_table)
    write_record(record, stats)
    return stats


def invalidate_downstream(root: Path, source: str, shard: str) -> None:
    """Remove the done records of the stages computed from `shard` (and the whole-source
    stages), so the next build-latents run redoes them."""
    for stage in DOWNSTREAM:
        stats_path(root, source, stage, shard).unlink(missing_ok=True)
    for stage in DOWNSTREAM_ALL:
        for p in (root / source / stage).glob("*.stats.json"):
            p.unlink()
    bump_generation(root, source)


def _sample_table(
    filtered: pa.Table,
    status: pa.Table,
    fetched: list[tuple[str, int | None, int | None]],
    source: str,
) -> pa.Table:
    """The shard's sample table: metadata scores + stored size, sha256 of the served bytes,
    status (`success` or the drop reason) and img2dataset's error (or the decode rule's)."""
    by_key = {
        k: (e, sha)
        for k, e, sha in zip(
            status[KEY_COLUMN].to_pylist(),
            status["error_message"].to_pylist(),
            status["sha256"].to_pylist(),
            strict=True,
        )
    }
    keys = filtered["key"].to_pylist()
    errors, hashes = zip(*(by_key[k] for k in keys), strict=True) if keys else ((), ())
    statuses = [f[0] for f in fetched]
    messages = [
        e if e is not None or s == "success" else f"decode rules: {s}"
        for e, s in zip(errors, statuses, strict=True)
    ]
    out = filtered.drop_columns(
        [c for c in ("width", "height", "source") if c in filtered.column_names]
    )
    return (
        out.append_column("source", pa.array([source] * len(keys), pa.string()))
        .append_column("width", pa.array([f[1] for f in fetched], pa.int64()))
        .append_column("height", pa.array([f[2] for f in fetched], pa.int64()))
        .append_column("sha256", pa.array(list(hashes), pa.string()))
        .append_column("status", pa.array(statuses, pa.string()))
        .append_column("error_message", pa.array(messages, pa.string()))
    )


if __name__ == "__main__":
    serve()
