"""How an agent died, as its node tells after (flows/execution/death_notes.py): a fatal
signal's report written by the dying process itself, the OOM kills its cgroup counted while it
ran (cgroup v1 and v2 files as the kernel lays them out), nothing where it left nothing."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import time

import pytest

from flows.execution import death_notes

DIES = """
import ctypes, os, sys
from flows.execution import death_notes
death_notes.begin(sys.argv[1])
def decode():
    ctypes.string_at(0)
if sys.argv[2] == "segv":
    decode()
os._exit(3)
"""


@pytest.fixture
def notes(tmp_path, monkeypatch):
    """The notes' folder; what `begin` did to this process (faulthandler's file) undone after,
    so a later crash in this process reports to stderr again."""
    monkeypatch.setenv(death_notes.FOLDER_ENV, str(tmp_path / "notes"))
    was_enabled = faulthandler.is_enabled()
    yield tmp_path / "notes"
    if was_enabled:
        faulthandler.enable(file=sys.__stderr__)
    else:
        faulthandler.disable()
    while death_notes._open:
        death_notes._open.pop().close()


def die(mark: str, how: str) -> int:
    return subprocess.run([sys.executable, "-c", DIES, mark, how], capture_output=True).returncode


def test_a_fatal_signal_is_named_with_where_it_struck(notes):
    assert die("run1-3", "segv") == -11
    note, report = death_notes.read("run1-3")
    assert note is not None and note.startswith("Segmentation fault in string_at ("), note
    assert ", from decode (<string>:6): a fatal signal" in note, note
    assert 'File "<string>", line 8 in <module>' in report, report  # the whole stack
    assert death_notes.read("run1-3") == (None, "")  # read once: its files are gone


def test_an_exit_without_a_report_or_an_oom_kill_tells_nothing(notes):
    assert die("run1-4", "exit") == 3
    assert death_notes.read("run1-4") == (None, "")
    assert list(notes.iterdir()) == []


def test_oom_kills_counted_while_it_ran_are_told(notes, monkeypatch):
    monkeypatch.setattr(death_notes, "oom_kills", lambda: 4)
    death_notes.begin("run1-5")
    monkeypatch.setattr(death_notes, "oom_kills", lambda: 6)
    note, _ = death_notes.read("run1-5")
    assert note == "the kernel's OOM killer killed 2 process(es) of its memory cgroup while it ran"


def test_a_runs_notes_go_at_its_end_and_no_other_runs(notes):
    death_notes.begin("run2-1")
    death_notes.begin("run3-1")
    death_notes.forget("run2-")
    assert sorted(p.name for p in notes.iterdir()) == ["run3-1.fault", "run3-1.oom"]


def test_an_agent_that_cannot_write_its_notes_runs_without(notes, tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(death_notes.FOLDER_ENV, str(tmp_path / "a-file" / "notes"))
    was = faulthandler.is_enabled()
    assert death_notes.begin("run4-1") is False
    assert "agent run4-1 keeps no death note" in caplog.text
    assert faulthandler.is_enabled() == was  # left as it was
    assert death_notes.read("run4-1") == (None, "")


def test_notes_no_run_removed_go_after_a_week(notes):
    notes.mkdir()
    (notes / "old-1.fault").write_text("")
    week_ago = time.time() - death_notes.KEEP_S - 60
    os.utime(notes / "old-1.fault", (week_ago, week_ago))
    (notes / "recent-1.fault").write_text("")
    death_notes.begin("run5-1")
    assert sorted(p.name for p in notes.iterdir()) == [
        "recent-1.fault",
        "run5-1.fault",
        "run5-1.oom",
    ]


def test_the_default_folder_is_the_users_own(monkeypatch):
    monkeypatch.delenv(death_notes.FOLDER_ENV, raising=False)
    assert death_notes.folder().name == f"sdpipe-agent-notes-{os.getuid()}"


@pytest.mark.parametrize(
    "proc, files, count",
    [
        ("0::/a/b\n", {"a/b/memory.events": "low 0\nmax 3\noom 2\noom_kill 2\n"}, 2),
        ("0::/a/b\n", {"memory.events": "oom 1\noom_kill 1\n"}, 1),  # a container's root
        ("4:memory:/x/y\n1:cpu:/\n", {"memory/x/y/memory.oom_control": "oom_kill 5\n"}, 5),
        ("4:memory:/x/y\n", {"memory/memory.oom_control": "oom_kill_disable 0\noom_kill 7\n"}, 7),
        ("4:memory:/x/y\n", {}, None),
        ("garbled\n0::/\n", {"memory.events": "oom_kill 3\n"}, 3),  # a line it cannot read
    ],
)
def test_oom_kills_read_from_cgroup_v1_and_v2(tmp_path, proc, files, count):
    (tmp_path / "cgroup").write_text(proc)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    assert death_notes.oom_kills(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == count
