"""The shard contract every stage follows: paths, stats records, resumability.

A shard's stage output is done when its stats record `<stage>/NNNNN.stats.json` exists and
the outputs it lists (each file's name and size) are still there; the record is written last,
after every output file has been renamed into place and synced to disk, so a killed stage (or
machine) leaves at most hidden temporaries, never a half-written file under a final name. A
record whose outputs are gone (a deleted folder) is not "done": the unit runs again. Files are
written by the atomic writes of sdtrain/atomic.py, which the trainer's checkpoints share.

A shard whose work raised leaves a failure record `<stage>/NNNNN.failed.json` (error type and
message, host, pid, time); the shard's next successful run removes it. `sdpipe status` reads
both records, so it can tell done, running and failed shards with the server down.

Nothing here lists a stage folder per shard (a folder holds every shard's files: 10,000 shards
with buckets are some 50,000 names, and a listing per shard makes a pass quadratic): a record's
outputs are the files its work wrote through `atomic_path` (`collect_writes`), and a shard's
temporaries are looked for only when its marker (`.NNNNN.unit.tmp-running`, there while its work
runs) says an earlier run of it was killed. Each start, done and failure is also appended to the
stage's progress journal, `<root>/.progress/<source>/<stage>.jsonl`, which the progress watcher
reads as it grows instead of listing the folder (best effort: a display, not a record).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sdtrain.atomic import (
    TMP_MARK,
    atomic_path,
    clean_temporaries,
    collect_writes,
    write_json_atomic,
)

# The shard name of a unit that is a whole stage (filter, filter-pixels, an adapter's index):
# it owns every file of its folder, temporaries included.
WHOLE_STAGE = "all"
RECORD_SUFFIXES = (".stats.json", ".failed.json")
# A per-shard unit's marker, there while its work runs (a temporary by name: `sdpipe status`
# counts it as running, and the cleaning of a killed run's temporaries removes it).
UNIT_MARK = f"unit{TMP_MARK}running"

log = logging.getLogger(__name__)


def data_root(root: str | Path | None = None) -> Path:
    """The data root: the argument, else `SDPIPE_DATA`, else `./data`."""
    return Path(root or os.environ.get("SDPIPE_DATA") or "data").absolute()


def shard_name(index: int) -> str:
    return f"{index:05d}"


def current_node() -> str:
    """The node this process works for: `SDPIPE_NODE` (a cluster's node agents set it, see
    flows/execution/cluster.py), else the host name."""
    return os.environ.get("SDPIPE_NODE") or socket.gethostname()


def stage_dir(root: Path, source: str, stage: str) -> Path:
    return root / source / stage


def stats_path(root: Path, source: str, stage: str, shard: str) -> Path:
    return stage_dir(root, source, stage) / f"{shard}.stats.json"


def failure_path(root: Path, source: str, stage: str, shard: str) -> Path:
    return stage_dir(root, source, stage) / f"{shard}.failed.json"


@dataclass(kw_only=True, slots=True)
class ShardStats:
    """What a stage did to one shard: samples in, samples out, drops by reason."""

    stage: str
    source: str
    shard: str
    num_in: int = 0
    num_out: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    # The unit's output files (name in the stage folder -> bytes; -1: a folder), checked before
    # a record counts as done. Empty in records of older sdpipe versions: not checked.
    outputs: dict[str, int] = field(default_factory=dict)
    skipped: bool = False  # True when the shard was already done and nothing ran
    # The node that did the work (`current_node`): a host name, or a cluster node's name.
    # Empty in records of older sdpipe versions.
    node: str = ""

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def check_balanced(self) -> None:
        """Every input sample is either kept or dropped under a reason."""
        num_dropped = sum(self.dropped.values())
        if self.num_in != self.num_out + num_dropped:
            raise AssertionError(
                f"{self.stage} {self.source}/{self.shard}: {self.num_in} in != "
                f"{self.num_out} out + {num_dropped} dropped {self.dropped}"
            )

    @classmethod
    def read(cls, path: Path) -> ShardStats:
        return cls(**json.loads(path.read_text()))


def read_stats(root: Path, source: str, stage: str) -> list[ShardStats]:
    """All stats records of a stage, in shard order."""
    d = stage_dir(root, source, stage)
    return [ShardStats.read(p) for p in sorted(d.glob("*.stats.json"))] if d.is_dir() else []


def unit_files(directory: Path, shard: str) -> dict[str, int]:
    """The output files of one unit in its stage folder: name -> bytes (-1 for a folder).

    A shard's outputs are named `<shard>.*`; a whole-stage unit owns the folder. Records and
    hidden temporaries are not outputs.
    """
    if not directory.is_dir():
        return {}
    out = {}
    for p in directory.iterdir():
        name = p.name
        if name.startswith(".") or name.endswith(RECORD_SUFFIXES):
            continue
        if shard == WHOLE_STAGE or name.startswith(f"{shard}."):
            out[name] = -1 if p.is_dir() else p.stat().st_size
    return out


def missing_outputs(directory: Path, outputs: dict[str, int]) -> list[str]:
    """The recorded outputs that are gone or changed size."""
    missing = []
    for name, size in outputs.items():
        p = directory / name
        if size < 0:
            ok = p.is_dir()
        else:
            try:
                ok = p.stat().st_size == size
            except OSError:
                ok = False
        if not ok:
            missing.append(name)
    return missing


def done_record(root: Path, source: str, stage: str, shard: str) -> ShardStats | None:
    """The unit's stats record if the unit is done (record there, its outputs intact), else None.

    A record whose outputs are gone is removed, with a warning: the unit is redone.
    """
    record = stats_path(root, source, stage, shard)
    try:
        stats = ShardStats.read(record)
    except FileNotFoundError:
        return None
    if missing := missing_outputs(record.parent, stats.outputs):
        log.warning(
            "%s %s/%s: outputs gone (%s); its record is removed and the unit runs again",
            stage,
            source,
            shard,
            ", ".join(sorted(missing)[:5]),
        )
        record.unlink(missing_ok=True)
        return None
    return stats


def is_done(root: Path, source: str, stage: str, shard: str) -> bool:
    return done_record(root, source, stage, shard) is not None


def written_files(directory: Path, shard: str, written: list[Path]) -> dict[str, int]:
    """`unit_files` of the files among `written` (what the unit's work renamed into place):
    one stat per output, no listing."""
    out = {}
    for p in written:
        if p.parent != directory or not p.name.startswith(f"{shard}."):
            continue
        if p.name.endswith(RECORD_SUFFIXES):
            continue
        with contextlib.suppress(FileNotFoundError):  # written, then removed by the work
            out[p.name] = -1 if p.is_dir() else p.stat().st_size
    return dict(sorted(out.items()))


def write_record(record: Path, stats: ShardStats, written: list[Path] | None = None) -> None:
    """The unit's stats record, with its outputs as they are on disk now; written last.

    `written`: the files the unit's work wrote (`collect_writes`); a shard's outputs are those
    of them, found without listing the folder. Without them (a whole-stage unit, or work that
    wrote through other threads) the folder is listed (`unit_files`).
    """
    outputs = None
    if written and stats.shard != WHOLE_STAGE:
        outputs = written_files(record.parent, stats.shard, written)
    stats.outputs = outputs or unit_files(record.parent, stats.shard)
    stats.node = stats.node or current_node()
    write_json_atomic(record, asdict(stats))
    journal(record.parent, stats.shard, "done", num_in=stats.num_in, seconds=stats.seconds)


def journal_path(directory: Path) -> Path:
    """The progress journal of the stage folder `<root>/<source>/<stage>`."""
    return directory.parent.parent / ".progress" / directory.parent.name / f"{directory.name}.jsonl"


def journal(directory: Path, shard: str, event: str, **fields) -> None:
    """Append one event (start, done, failed) of a unit to its stage's progress journal: one
    short line in one append, whole on a local disk even with many writers. Best effort."""
    line = json.dumps({"shard": shard, "event": event, **fields}, separators=(",", ":")) + "\n"
    with contextlib.suppress(OSError):
        path = journal_path(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line)


def run_shard(
    root: Path,
    source: str,
    stage: str,
    shard: str,
    work: Callable[[ShardStats], None],
    *,
    started: float | None = None,
) -> ShardStats:
    """Run `work` for one shard unless it is done (`done_record`).

    `work` writes its outputs (each through `atomic_path`) and fills in the stats; the stats
    record is written after it returns, which marks the shard done. `started`: when the
    shard's work began (`time.perf_counter()`), where it began before `work` (a pipeline).
    """
    record = stats_path(root, source, stage, shard)
    if (stats := done_record(root, source, stage, shard)) is not None:
        stats.skipped = True
        return stats
    marker = start_unit(record.parent, shard)
    stats = ShardStats(stage=stage, source=source, shard=shard)
    start = time.perf_counter() if started is None else started
    failure = failure_path(root, source, stage, shard)
    try:
        with collect_writes() as written:
            work(stats)
        stats.seconds = round(time.perf_counter() - start, 3)
        stats.check_balanced()
        write_record(record, stats, written)
    except Exception as e:
        write_failure(failure, e, time.perf_counter() - start)
        journal(record.parent, shard, "failed")
        raise
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
    failure.unlink(missing_ok=True)
    return stats


def start_unit(directory: Path, shard: str) -> Path | None:
    """Remove what a killed run of the unit left, and mark the unit as running (a per-shard
    unit; returns its marker). A whole-stage unit owns the folder: its temporaries are all
    there are, listed once per run. A shard's are looked for only when its marker survived a
    run of it, one that was killed (work that raises removes its own temporaries)."""
    journal(directory, shard, "start", node=current_node())
    if shard == WHOLE_STAGE:
        clean_temporaries(directory)
        return None
    marker = directory / f".{shard}.{UNIT_MARK}"
    if marker.exists():
        clean_temporaries(directory, f"{shard}.")
    directory.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return marker


def write_failure(path: Path, error: BaseException, seconds: float) -> None:
    """The failure record of a shard; best effort: it never hides the error itself."""
    with contextlib.suppress(OSError):
        write_json_atomic(
            path,
            {
                "error": type(error).__name__,
                "message": str(error)[:2000],
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "seconds": round(seconds, 3),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )


def summarize(stats: list[ShardStats]) -> dict:
    """Totals over a stage's shards: samples in/out and drops per reason."""
    dropped: Counter[str] = Counter()
    for s in stats:
        dropped.update(s.dropped)
    return {
        "num_shards": len(stats),
        "num_in": sum(s.num_in for s in stats),
        "num_out": sum(s.num_out for s in stats),
        "dropped": dict(sorted(dropped.items())),
    }


def generation_path(root: Path, source: str) -> Path:
    return root / source / "generation"


def generation(root: Path, source: str) -> int:
    """How many times a source's finished shards were changed in place (e.g. by a refetch).

    Part of the flows' cache keys: a cached "done" of an earlier generation is not reused,
    while the stages' own records still skip every shard whose record survived.
    """
    path = generation_path(root, source)
    return int(path.read_text()) if path.exists() else 0


def bump_generation(root: Path, source: str) -> int:
    new = generation(root, source) + 1
    with atomic_path(generation_path(root, source)) as tmp:
        tmp.write_text(str(new))
    return new
