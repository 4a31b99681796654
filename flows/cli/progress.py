"""Progress in the terminal: per stage, shards done / total, samples/s and ETA, while a flow runs.

It watches the records the stages leave under the data root (as `sdpipe status` reads them), not
the flow's events, so one watcher serves the flows run here (`sdpipe build-latents`, `sdpipe
curriculum`) and the ones a worker runs (`make demo`). On a terminal it is a live display above
which the logs scroll; elsewhere (CI logs) plain lines: a stage's start, every PLAIN_EVERY_S, end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from flows.cli.status import PER_SHARD, STAGES
from sdtrain.atomic import TMP_MARK
from tasks.runtime.shards import journal_path

POLL_S = 1.0
PLAIN_EVERY_S = 30.0
# Stages with one unit for the whole source.
SINGLE_UNIT = ("filtered", "selected")


@dataclass(kw_only=True, slots=True)
class Line:
    """One stage (or training) as shown: `done` of `total` units, a rate and an ETA."""

    label: str
    unit: str  # shards, steps, views; "" for a stage of one unit
    done: int = 0
    total: int | None = None
    failed: int = 0
    rate: float | None = None  # samples/s
    eta_s: float | None = None
    finished: bool = False

    def text(self) -> str:
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        parts = [f"{self.label}: {count}{f' {self.unit}' if self.unit else ''}"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.rate is not None:
            parts.append(f"{self.rate:.1f} samples/s")
        if self.finished:
            parts.append("done")
        elif self.eta_s is not None:
            parts.append(f"ETA {format_seconds(self.eta_s)}")
        return ", ".join(parts)


def format_seconds(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


class StageWatch:
    """One stage folder, read incrementally: only what happened since the last poll."""

    def __init__(self, root: Path, source: str, stage: str):
        self.root, self.source, self.stage = root, source, stage
        self.dir = root / source / stage
        self.done: dict[str, int] = {}  # shard -> samples in
        self.preexisting: set[str] | None = None  # done before the watch began
        self.failed: set[str] = set()
        self.running: set[str] = set()
        self.started: float | None = None  # when this watch first saw the stage work
        self.ended: float | None = None  # finished: no longer polled
        self.new_samples = 0
        self.longest_s = 0.0  # the longest shard seen: a floor of the time the stage took
        self.last_poll: float | None = None
        self.total: int | None = None
        self.journal = journal_path(self.dir)
        self.offset = 0  # how far the journal is read
        self.folder_mtime: int | None = None

    def poll(self, now: float) -> None:
        """What changed since the last poll. The folder is listed at the first poll (what was
        done before) and, until the stage starts, when its folder changed; from then on only
        the lines the stage's progress journal gained are read: a poll costs what happened
        since the last, not the number of shards."""
        if self.ended is not None:
            return
        if self.preexisting is None:
            self.offset = self._journal_size()
            self._from_listing()
        elif self.started is None and self._folder_changed():
            self._from_listing()
        self._from_journal()
        if self.started is None and (self.running or len(self.done) > len(self.preexisting)):
            self.started = now if self.last_poll is None else self.last_poll  # began in between
        self.last_poll = now

    def _journal_size(self) -> int:
        try:
            return self.journal.stat().st_size
        except OSError:
            return 0

    def _folder_changed(self) -> bool:
        try:
            mtime = self.dir.stat().st_mtime_ns
        except OSError:
            return False
        changed, self.folder_mtime = mtime != self.folder_mtime, mtime
        return changed

    def _from_listing(self) -> None:
        try:
            self.folder_mtime = self.dir.stat().st_mtime_ns
            names = [p.name for p in self.dir.iterdir()]
        except OSError:  # not there yet, or being replaced (filter-pixels restarts its folder)
            names = []
        records = {n.split(".")[0] for n in names if n.endswith(".stats.json") and n[0] != "."}
        failures = {n.split(".")[0] for n in names if n.endswith(".failed.json") and n[0] != "."}
        self.running = {n.lstrip(".").split(".")[0] for n in names if TMP_MARK in n}
        if self.preexisting is None:
            self.preexisting = set(records)
        for shard in records - set(self.done):
            try:
                record = json.loads((self.dir / f"{shard}.stats.json").read_text())
            except (OSError, ValueError):
                continue  # replaced while read: the next poll reads it
            self._done(shard, record["num_in"], record["seconds"])
        self.failed = failures - set(self.done)

    def _from_journal(self) -> None:
        try:
            with open(self.journal, "rb") as f:
                if self.journal.stat().st_size < self.offset:
                    self.offset = 0  # the journal was started again
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next poll
        self.offset += len(complete)
        for raw in complete.splitlines():
            try:
                event = json.loads(raw)
                shard, kind = event["shard"], event["event"]
            except (ValueError, KeyError, TypeError):
                continue
            if kind == "start":
                self.running.add(shard)
            elif kind == "done":
                self.running.discard(shard)
                self.failed.discard(shard)
                self._done(shard, event.get("num_in", 0), event.get("seconds", 0.0))
            elif kind == "failed":
                self.running.discard(shard)
                if shard not in self.done:
                    self.failed.add(shard)

    def _done(self, shard: str, num_in: int, seconds: float) -> None:
        if shard in self.done:
            return
        self.done[shard] = num_in
        if shard not in (self.preexisting or ()):
            self.new_samples += num_in
            self.longest_s = max(self.longest_s, seconds)

    @property
    def active(self) -> bool:
        return self.started is not None or bool(self.done or self.failed)

    def expected(self) -> int | None:
        """The stage's number of units, where the data root tells it (fixed once known)."""
        if self.total is None and self.stage in SINGLE_UNIT:
            self.total = 1
        elif self.total is None and self.stage in PER_SHARD:
            for folder in ("filtered", "metadata"):  # URL sources' filter, archives' index
                path = self.root / self.source / folder
                shards = list(path.glob("[0-9]*.parquet")) if path.is_dir() else []
                if shards:
                    self.total = len(shards)
                    break
        return self.total  # None: fetch-metadata of a URL source, views: the flow's to know

    def line(self, now: float, total: int | None) -> Line:
        line = Line(
            label=f"{STAGES[self.stage]} {self.source}",
            unit={"views": "views", **dict.fromkeys(SINGLE_UNIT, "")}.get(self.stage, "shards"),
            done=len(self.done),
            total=total,
            failed=len(self.failed),
        )
        new_done = len(self.done) - len(self.preexisting or ())
        if self.started is not None and new_done:
            elapsed = max((self.ended or now) - self.started, self.longest_s, 1e-3)
            line.rate = self.new_samples / elapsed
            if total is not None:
                line.eta_s = (total - len(self.done) - len(self.failed)) * elapsed / new_done
        return line


class PhaseWatch:
    """A phase's mix and training, from `phases/<phase>/mix.json` and `runs/<phase>/log.jsonl`."""

    def __init__(self, root: Path, phase: str):
        self.phase = phase
        self.mix = root / "phases" / phase / "mix.json"
        self.log = root / "runs" / phase / "log.jsonl"
        self.summary = root / "runs" / phase / "summary.json"
        self.offset = 0
        self.last: dict | None = None  # the newest step record
        self.first: tuple[float, int] | None = None  # (when, step) of the first step seen

    def poll(self, now: float) -> None:
        if not self.log.exists():
            return
        with open(self.log, "rb") as f:
            if self.log.stat().st_size < self.offset:
                self.offset = 0  # a resumed run rewrote its log
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next poll
        self.offset += len(complete)
        for raw in complete.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(raw)
                if "loss" in record:
                    self.last = record
                    if self.first is None:
                        self.first = (now, record["step"])

    def lines(self, now: float) -> list[Line]:
        out = []
        if self.mix.exists():
            with contextlib.suppress(OSError, ValueError, KeyError):
                n = json.loads(self.mix.read_text())["num_samples"]
                out.append(
                    Line(label=f"mix {self.phase}", unit="samples", done=n, total=n, finished=True)
                )
        if self.last is not None:
            step, total = self.last["step"], self.last.get("total_steps")
            line = Line(
                label=f"train {self.phase}",
                unit="steps",
                done=step,
                total=total,
                rate=self.last.get("samples_per_s"),
                finished=self.summary.exists(),
            )
            first_time, first_step = self.first
            if total is not None and step > first_step:
                line.eta_s = (total - step) * (now - first_time) / (step - first_step)
            out.append(line)
        return out


class Watcher:
    """The lines of some sources' stages and some phases, polled from the data root."""

    def __init__(self, root: Path, *, sources: list[str] = (), phases: list[str] = ()):
        self.stages = [StageWatch(root, s, stage) for s in sources for stage in STAGES]
        self.phases = [PhaseWatch(root, p) for p in phases]

    def poll(self, now: float | None = None) -> list[Line]:
        """The lines as of `now` (default: the monotonic clock)."""
        now = time.monotonic() if now is None else now
        for w in self.stages:
            w.poll(now)
        lines = []
        active = [w for w in self.stages if w.active]
        for i, w in enumerate(active):
            total = w.expected()
            if total is None and any(v.source == w.source for v in active[i + 1 :]):
                total = len(w.done) + len(w.failed)  # a later stage began: this one had them all
            line = w.line(now, total)
            line.finished = total is not None and line.done + line.failed >= total
            if line.finished and w.ended is None:
                w.ended = now
            lines.append(line)
        for p in self.phases:
            p.poll(now)
            lines += p.lines(now)
        return lines


class PlainRenderer:
    """Lines for logs: a stage's first sight, a change at most every PLAIN_EVERY_S, its end."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.shown: dict[str, tuple[float, tuple]] = {}  # label -> (when, what it showed)

    def show(self, lines: list[Line], *, final: bool = False) -> None:
        now = time.monotonic()
        for line in lines:
            state = (line.done, line.failed, line.finished)
            when, shown = self.shown.get(line.label, (None, None))
            if shown == state:
                continue
            if when is None or line.finished or final or now - when >= PLAIN_EVERY_S:
                print(f"progress: {line.text()}", file=self.stream, flush=True)
                self.shown[line.label] = (now, state)

    def close(self) -> None:
        pass


class LiveRenderer:
    """A rich live display, one row per stage, on the console Prefect logs to, so the log lines
    scroll above it instead of tearing it. Styles are named colours: that console's theme has
    none of rich's default names (`bar.back`, ...)."""

    def __init__(self, console):
        from rich.progress import BarColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("{task.description:<24}"),
            BarColumn(
                bar_width=30,
                style="grey37",
                complete_style="cyan",
                finished_style="green",
                pulse_style="cyan",
            ),
            TextColumn("{task.fields[info]}"),
            console=console,
            refresh_per_second=4,
        )
        self.tasks: dict[str, int] = {}
        self.progress.start()

    def show(self, lines: list[Line], *, final: bool = False) -> None:
        for line in lines:
            info = line.text().split(": ", 1)[1]
            if line.label not in self.tasks:
                self.tasks[line.label] = self.progress.add_task(line.label, info=info, total=None)
            self.progress.update(
                self.tasks[line.label],
                completed=line.done,
                total=line.total if line.total else None,
                info=info,
            )

    def close(self) -> None:
        self.progress.stop()


def _prefect_console():
    """The rich console of Prefect's log handler, if this process logs through one."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler":
            return handler.console
    return None


@contextlib.contextmanager
def watch(
    root: Path,
    *,
    sources: list[str] = (),
    phases: list[str] = (),
    stream: TextIO | None = None,
) -> Iterator[Watcher]:
    """Show the progress of `sources`' stages and `phases` while the block runs: live on a
    terminal, plain lines otherwise."""
    from rich.console import Console

    stream = stream or sys.stderr
    watcher = Watcher(root, sources=sources, phases=phases)
    if stream.isatty():
        console = _prefect_console() if stream is sys.stderr else None
        renderer = LiveRenderer(console or Console(file=stream))
    else:
        renderer = PlainRenderer(stream)
    stop = threading.Event()
    broken: list[Exception] = []

    def show(final: bool = False) -> None:
        # The display is a view of the work: if it breaks, it says so once and the work goes on
        # (and the flow's own error, if any, is the one the command ends with).
        if broken:
            return
        try:
            renderer.show(watcher.poll(), final=final)
        except Exception as e:
            broken.append(e)
            print(f"progress display stopped: {type(e).__name__}: {e}", file=stream)

    def run() -> None:
        while not stop.wait(POLL_S):
            show()

    show()  # what was done before: shown as done, not counted in the rates
    thread = threading.Thread(target=run, name="sdpipe-progress", daemon=True)
    thread.start()
    try:
        yield watcher
    finally:
        stop.set()
        thread.join()
        show(final=True)
        renderer.close()
