"""How a build's agent died, as its node can tell afterwards: the report Python's faulthandler
wrote at a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL, with where the thread that
died was) and the kernel's OOM kills its memory cgroup counted while it ran. Ray 2.60 says
"connection error code 2" for all of these and for a SIGKILL alike (cluster_agents.how_it_died).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import tempfile
import time
from pathlib import Path

# Where a node's notes go (default: <tmp>/sdpipe-agent-notes-<uid>).
FOLDER_ENV = "SDPIPE_AGENT_NOTES"
KEEP_S = 7 * 86400  # notes a run never removed (its flow process was killed) go after this long
_open: list = []  # the agent's report file: faulthandler writes to its descriptor when it dies
log = logging.getLogger(__name__)


def folder() -> Path:
    default = Path(tempfile.gettempdir()) / f"sdpipe-agent-notes-{os.getuid()}"  # a user's own
    return Path(os.environ.get(FOLDER_ENV) or default)


def begin(mark: str) -> bool:
    """In a starting agent: a fatal signal's report goes to `<mark>.fault`, and the OOM kills
    its cgroup counted so far to `<mark>.oom`, for `read` after its death. Best effort: where
    the folder cannot be written the agent runs without notes (False), and its death is told
    in Ray's words alone."""
    notes = folder()
    try:
        notes.mkdir(parents=True, exist_ok=True)
        _forget_old(notes)
        count = oom_kills()
        tmp = notes / f".{mark}.oom.tmp"
        tmp.write_text("" if count is None else str(count))
        tmp.replace(notes / f"{mark}.oom")
        report = open(notes / f"{mark}.fault", "w")  # noqa: SIM115 - open for the process's life
    except OSError as e:
        log.warning("agent %s keeps no death note (%s: %s)", mark, notes, e)
        return False
    faulthandler.enable(file=report, all_threads=False)
    _open.append(report)
    return True


def read(mark: str) -> tuple[str | None, str]:
    """(How the agent `mark` died as its node tells it, its fatal-signal report whole); the
    first None where the node tells nothing (a SIGKILL not from the kernel's OOM killer, an
    exit from native code). Its notes removed."""
    notes = folder()
    fault = _take(notes / f"{mark}.fault") or ""
    before = _take(notes / f"{mark}.oom")
    if (m := re.search(r"Fatal Python error: ([^\n]+)", fault)) is not None:
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', fault)
        # The innermost frame and its caller: a library's wrapper, then the code that called it.
        called = [f"{fn} ({Path(file).name}:{line})" for file, line, fn in frames[:2]]
        where = f" in {', from '.join(called)}" if called else ""
        return f"{m[1].strip()}{where}: a fatal signal, as its faulthandler reported", fault
    after = oom_kills()
    if before and after is not None and after > int(before):
        return (
            f"the kernel's OOM killer killed {after - int(before)} process(es) of its memory "
            "cgroup while it ran"
        ), fault
    return None, fault


def forget(prefix: str) -> None:
    """Remove the notes of every agent whose mark starts with `prefix` (a run's, at its end)."""
    with contextlib.suppress(FileNotFoundError):
        for path in folder().iterdir():
            if path.name.lstrip(".").startswith(prefix):
                path.unlink(missing_ok=True)


def oom_kills(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The kernel's OOM kills counted in this process's memory cgroup (v2 `memory.events`, v1
    `memory.oom_control`; in a container the mount's root is the cgroup), None where unread."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:
        if line.count(":") < 2:
            continue
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            places += [Path(root, path.lstrip("/"), "memory.events"), Path(root, "memory.events")]
        elif "memory" in controllers.split(","):
            base = Path(root, "memory")
            places += [base / path.lstrip("/") / "memory.oom_control", base / "memory.oom_control"]
    for place in places:
        with contextlib.suppress(OSError):
            if (m := re.search(r"^oom_kill (\d+)$", place.read_text(), re.M)) is not None:
                return int(m[1])
    return None


def _forget_old(notes: Path) -> None:
    """Notes older than KEEP_S: their run ended without removing them (or its node was lost)."""
    now = time.time()
    for path in notes.iterdir():
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > KEEP_S:
                path.unlink()


def _take(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    path.unlink(missing_ok=True)
    return text
