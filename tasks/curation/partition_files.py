"""Partition files of the partitioned global stages, and the tasks that write them.

A task's output is one folder, named by the task's inputs (a rerun finds it and reuses it),
written under a temporary name and renamed whole: a folder under its final name is complete.
Arrays inside are sorted by the downstream partition they go to, with their offsets beside them,
so a downstream task memory-maps its slice of each upstream folder, never the whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

RECORD = "record.json"


def digest(*parts) -> str:
    """A short, stable name for a set of inputs (JSON-able parts)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_identity(path: str | Path) -> list:
    """What names an input file in a digest: its path, size and modification time."""
    stat = os.stat(path)
    return [str(path), stat.st_size, stat.st_mtime_ns]


def save_partitioned(folder: Path, name: str, columns: dict, dest: np.ndarray, num: int):
    """`columns` (equal lengths) sorted by `dest` (each row's partition, 0..num-1), one file a
    column, and offsets [num + 1] beside them."""
    order = np.argsort(dest, kind="stable")  # radix sort for small integer types
    for column, values in columns.items():
        np.save(folder / f"{name}.{column}.npy", values[order])
    counts = np.bincount(dest, minlength=num)
    np.save(folder / f"{name}.offsets.npy", np.concatenate([[0], np.cumsum(counts)]))


def read_part(
    folder: Path, name: str, part: int, columns: Sequence[str], stop: int | None = None
) -> dict:
    """Partition `part` (to `stop`, if given: partitions part..stop-1) of a `save_partitioned`
    table, read through memory maps."""
    offsets = np.load(folder / f"{name}.offsets.npy")
    stop = part + 1 if stop is None else stop
    out = {}
    for column in columns:
        data = np.load(folder / f"{name}.{column}.npy", mmap_mode="r")
        out[column] = np.array(data[offsets[part] : offsets[stop]])
    return out


def gather(folders: Sequence[Path], name: str, part: int, dtypes: dict) -> dict:
    """Partition `part` of table `name` from every upstream folder, concatenated by column
    (`dtypes`: column -> dtype, for when there is no folder)."""
    pieces = [read_part(f, name, part, list(dtypes)) for f in folders]
    return {
        column: np.concatenate([p[column] for p in pieces]) if pieces else np.zeros(0, dtype)
        for column, dtype in dtypes.items()
    }


def remove_stale(out: Path) -> int:
    """Removes what an earlier attempt at `out` left half-written (its temporary folders);
    returns how many. One attempt of a task runs at a time (the executor's contract), so a
    temporary folder present when an attempt starts belongs to one that died."""
    stale = list(out.parent.glob(f"{out.name}.tmp-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return len(stale)


def peak_rss_gb() -> float:
    """The process's peak resident memory (a worker's over the tasks it ran so far). Linux's
    VmHWM, not ru_maxrss: that one survives exec, so a spawned worker's starts at its parent's."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:  # not Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_task(root: Path, out: Path, work: Callable[..., dict], *args) -> dict:
    """Runs `work(tmp_folder, *args) -> counts` unless `out` (a folder under the stage's
    `root`) is done; returns the task's
    record: its counts, seconds, CPU seconds, the worker's peak RSS, host and pid. A done
    task's record comes back with `reused: true`."""
    if out.is_dir():
        return json.loads((out / RECORD).read_text()) | {"reused": True}
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = remove_stale(out)
    tmp = out.parent / f"{out.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    tmp.mkdir()
    start, cpu = time.perf_counter(), time.process_time()
    counts = work(tmp, *args)
    record = {"task": str(out.relative_to(root)), **counts}
    record |= {
        "seconds": round(time.perf_counter() - start, 3),
        "cpu_seconds": round(time.process_time() - cpu, 3),
        "peak_rss_gb": round(peak_rss_gb(), 3),
        "temp_bytes": sum(p.stat().st_size for p in tmp.iterdir()),
        "stale_removed": stale,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    (tmp / RECORD).write_text(json.dumps(record))
    try:
        tmp.rename(out)
    except OSError:  # another attempt finished first: its folder stands
        shutil.rmtree(tmp, ignore_errors=True)
        return json.loads((out / RECORD).read_text()) | {"reused": True}
    return record | {"reused": False}


class LocalProcesses:
    """Runs tasks in `workers` processes (spawned: a forked worker's peak RSS would start at
    its parent's); `workers` 0 runs them in this process, in order."""

    name = "local-processes"

    def __init__(self, workers: int):
        self.workers = workers
        self._pool = None
        if workers > 0:
            self._pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))

    def map(self, fn: Callable[..., dict], calls: Sequence[tuple]) -> list[dict]:
        if self._pool is None:
            return [fn(*call) for call in calls]
        return list(self._pool.map(fn, *zip(*calls, strict=True))) if calls else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> LocalProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def folder_bytes(root: Path) -> int:
    """Bytes of every file under `root` (the stage's temporary disk at this moment)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def runs_summary(runs: Sequence) -> dict:
    """What a stage's record keeps of its partitioned runs (each with `plan.num_parts`,
    `rounds`, `records` and `peak_temp_bytes`): tasks, reuse, nodes, temporary disk."""
    records = [r for run in runs for r in run.records]
    return {
        "runs": len(runs),
        "partitions": [run.plan.num_parts for run in runs],
        "rounds": [run.rounds for run in runs],
        "tasks": len(records),
        "reused": sum(bool(r.get("reused")) for r in records),
        "nodes": sorted({str(r.get("node") or r["host"]) for r in records}),
        "temp_bytes": max((run.peak_temp_bytes for run in runs), default=0),
    }
