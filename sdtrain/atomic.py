"""Atomic writes: a file or folder appears under its final name whole, or not at all.

Write to a hidden temporary beside the final name, sync it, rename it into place, sync the
folder. The stages' shard contract (tasks/runtime/shards.py) and the trainer's checkpoints both
write this way; it lives here, in the lower room, so sdtrain/ never imports tasks/.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"
# The final paths written through `atomic_path` in this thread since `collect_writes` began.
_written: contextvars.ContextVar[list[Path] | None] = contextvars.ContextVar(
    "sdpipe_atomic_writes", default=None
)


@contextlib.contextmanager
def collect_writes() -> Iterator[list[Path]]:
    """Yield a list that gathers every final path `atomic_path` renames into place in this
    thread (and its context) while the block runs: what a shard's work wrote, known without
    listing its folder. Writes in other threads or processes are not seen."""
    written: list[Path] = []
    token = _written.set(written)
    try:
        yield written
    finally:
        _written.reset(token)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a hidden temporary path beside `final`; rename it into place on success.

    On an exception the temporary is removed; on SIGKILL it stays hidden (dot-prefixed) and
    `clean_temporaries` removes it on the next run.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}")
    try:
        yield tmp
        fsync_path(tmp)  # the bytes are on disk before the name says they are
        os.replace(tmp, final)
        fsync_path(final.parent)  # ... and so is the rename
        if (written := _written.get()) is not None:
            written.append(final)
    finally:
        if tmp.exists():
            tmp.unlink()


def replace_dir(new: Path, final: Path) -> None:
    """Put the folder `new` at `final`, replacing what is there, with no moment where `final`
    is missing or mixed: the two are exchanged in one step (Linux renameat2 RENAME_EXCHANGE),
    then the old one, now at `new`, is removed. Where exchange is not available, the old
    folder is first renamed aside (a brief window without `final`)."""
    fsync_path(new)
    if not final.exists():
        os.replace(new, final)
    elif not _exchange(new, final):
        aside = final.with_name(f".{final.name}.old{TMP_MARK}{os.getpid()}")
        os.replace(final, aside)
        os.replace(new, final)
        new = aside
    fsync_path(final.parent)
    shutil.rmtree(new, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux >= 3.15); False where that is not possible."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return done == 0


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))


def clean_temporaries(directory: Path, name: str = "") -> int:
    """Remove temporaries that killed runs left for `name` (default: any); returns the count.

    Shards of a stage run concurrently in one folder, so a shard removes only its own.
    """
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if p.name.startswith(f".{name}") and TMP_MARK in p.name]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return len(stale)
