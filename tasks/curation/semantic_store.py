"""Semantic dedup's cluster-ordered embeddings on disk, written only in sequence.

Rows arrive part by part in no cluster order, so a slot-addressed map would be filled by random
writes. Instead each part appends its rows, grouped by bucket (a range of whole clusters), to
one run file per bucket; then bucket by bucket a run is read whole, put in slot order in memory,
appended to the store and deleted. Memory holds a part or a bucket (BUCKET_BYTES of runs, more
past MAX_BUCKETS x that: 1.3 GB at 100M rows of D = 768); the disk holds the store and the runs
not yet assembled: at most (8 + 2 D) bytes per slot plus a bucket's store. All of it lives in
one run's folder (`semantic_workdir`), held by a lease the run renews, not by its host and pid.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

BUCKET_BYTES = 256 << 20  # a bucket's runs, read whole while it is assembled
MAX_BUCKETS = 256  # run files open at once while the parts are copied
STORE_NAME = "semantic-slots.f16"
WRITE_ROWS = 65536  # rows per write while a bucket is assembled
WORKDIR_PREFIX = ".semantic.tmp-"
LEASE_NAME = "lease.json"
RENEW_SECONDS = 30.0  # a running stage touches its lease this often
# A lease untouched this long: its run is over. Ten renewals: room for clocks apart between
# hosts and for a shared filesystem's cached attributes (NFS: up to 60 s by default).
EXPIRE_SECONDS = 300.0


def cluster_ordered(
    parts, primary_slot: np.ndarray, visitor_slot: np.ndarray, offsets: np.ndarray, workdir: Path
) -> tuple[np.ndarray, int]:
    """(store fp16 [S, D], read-only map of `workdir`/STORE_NAME; the most bytes `workdir` held
    while it was built). `offsets`: each cluster's first slot, then S; a row's embedding goes to
    its `primary_slot` and to its `visitor_slot`s (-1: none)."""
    workdir = Path(workdir)
    num_slots, dim = int(offsets[-1]), parts.dim
    record = np.dtype([("slot", "<i8"), ("emb", "<f2", (dim,))])
    num_buckets = min(
        MAX_BUCKETS, len(offsets) - 1, math.ceil(num_slots * record.itemsize / BUCKET_BYTES)
    )
    # Bucket edges at cluster starts, near equal shares of the slots.
    targets = np.linspace(0, num_slots, max(1, num_buckets) + 1)
    edges = np.unique(offsets[np.searchsorted(offsets, targets)])
    runs = [workdir / f"semantic-run-{b:05d}" for b in range(len(edges) - 1)]
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(path, "wb")) for path in runs]
        for read in parts.readers:
            rows, emb = read()
            slots = np.concatenate([primary_slot[rows], *visitor_slot[rows].T])
            source = np.tile(np.arange(len(rows)), 1 + visitor_slot.shape[1])
            keep = np.flatnonzero(slots >= 0)
            by_slot = keep[np.argsort(slots[keep])]
            chunk = np.empty(len(by_slot), record)
            chunk["slot"], chunk["emb"] = slots[by_slot], emb[source[by_slot]]
            cuts = np.searchsorted(chunk["slot"], edges[1:-1])
            for file, run in zip(files, np.split(chunk, cuts), strict=True):
                run.tofile(file)
    store_path = workdir / STORE_NAME
    most = _bytes_in(workdir)
    with open(store_path, "wb") as store:
        for b, path in enumerate(runs):
            run = np.fromfile(path, record)
            order = np.empty(len(run), np.int64)
            order[run["slot"] - edges[b]] = np.arange(len(run))
            for start in range(0, len(run), WRITE_ROWS):
                run["emb"][order[start : start + WRITE_ROWS]].tofile(store)
            store.flush()
            del run, order  # before the next bucket is read: one in memory at a time
            most = max(most, _bytes_in(workdir))
            path.unlink()
    if not num_slots:
        return np.zeros((0, dim), np.float16), most
    return np.memmap(store_path, np.float16, "r", shape=(num_slots, dim)), most


def _bytes_in(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


@contextlib.contextmanager
def semantic_workdir(parent: Path) -> Iterator[Path]:
    """A folder of `parent` for one run's store (as large as the embeddings, twice over), removed
    after use. While the run lives a thread renews the lease in it; any folder here whose lease
    is over (`expired`) is a run that was killed, on this host or another, and goes first.
    Neither host nor pid decides: pids repeat (a container's run has the same one each time),
    and another host's processes cannot be asked."""
    parent = Path(parent)
    for folder in parent.glob(f"{WORKDIR_PREFIX}*"):
        if expired(folder):
            shutil.rmtree(folder, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=parent))
    lease = folder / LEASE_NAME
    lease.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))  # for people
    stop = threading.Event()
    renew = threading.Thread(target=_renew, args=(lease, stop), name="semantic-lease", daemon=True)
    renew.start()
    try:
        yield folder
    finally:
        stop.set()
        renew.join()
        shutil.rmtree(folder, ignore_errors=True)


def _renew(lease: Path, stop: threading.Event) -> None:
    while not stop.wait(RENEW_SECONDS):
        # Gone (taken as expired: the run then fails on its own) or a passing filesystem error:
        # the next renewal tries again.
        with contextlib.suppress(OSError):
            os.utime(lease)


def expired(folder: Path) -> bool:
    """True if the run that made `folder` is over: its lease (or, without one, the folder
    itself: a run about to write its lease, or one made before leases) was last touched more
    than EXPIRE_SECONDS ago, or it is a folder of before leases (`<prefix><host>-<pid>-<random>`)
    whose process on this host is gone, as it was judged then."""
    now = time.time()
    try:
        touched = folder.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile by another run
        return False
    try:
        renewed = (folder / LEASE_NAME).stat().st_mtime
    except FileNotFoundError:
        return now - touched > EXPIRE_SECONDS or _process_gone(folder.name)
    return now - max(touched, renewed) > EXPIRE_SECONDS


def _process_gone(name: str) -> bool:
    parts = name.removeprefix(WORKDIR_PREFIX).rsplit("-", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False
