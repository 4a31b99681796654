"""How an agent died, as its node tells after (flows/execution/death_notes.py): a fatal
signal's report written by the dying process itself, the OOM kills its cgroup counted while it
ran (cgroup v1 and v2 files as the kernel lays them out), nothing where it left nothing."""

from __future__ import annotations

import subprocess
import sys

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
    monkeypatch.setenv(death_notes.FOLDER_ENV, str(tmp_path / "notes"))
    return tmp_path / "notes"


def die(mark: str, how: str) -> int:
    return subprocess.run([sys.executable, "-c", DIES, mark, how], capture_output=True).returncode


def test_a_fatal_signal_is_named_with_where_it_struck(notes):
    assert die("run1-3", "segv") == -11
    note = death_notes.read("run1-3")
    assert note is not None and note.startswith("Segmentation fault in string_at ("), note
    assert ", from decode (<string>:6): a fatal signal" in note, note
    assert death_notes.read("run1-3") is None  # read once: its files are gone


def test_an_exit_without_a_report_or_an_oom_kill_tells_nothing(notes):
    assert die("run1-4", "exit") == 3
    assert death_notes.read("run1-4") is None
    assert list(notes.iterdir()) == []


def test_oom_kills_counted_while_it_ran_are_told(notes, monkeypatch):
    monkeypatch.setattr(death_notes, "oom_kills", lambda: 4)
    death_notes.begin("run1-5")
    monkeypatch.setattr(death_notes, "oom_kills", lambda: 6)
    note = death_notes.read("run1-5")
    assert note == "the kernel's OOM killer killed 2 process(es) of its memory cgroup while it ran"


def test_a_runs_notes_go_at_its_end_and_no_other_runs(notes):
    death_notes.begin("run2-1")
    death_notes.begin("run3-1")
    death_notes.forget("run2-")
    assert sorted(p.name for p in notes.iterdir()) == ["run3-1.fault", "run3-1.oom"]


@pytest.mark.parametrize(
    "proc, files, count",
    [
        ("0::/a/b\n", {"a/b/memory.events": "low 0\nmax 3\noom 2\noom_kill 2\n"}, 2),
        ("0::/a/b\n", {"memory.events": "oom 1\noom_kill 1\n"}, 1),  # a container's root
        ("4:memory:/x/y\n1:cpu:/\n", {"memory/x/y/memory.oom_control": "oom_kill 5\n"}, 5),
        ("4:memory:/x/y\n", {"memory/memory.oom_control": "oom_kill_disable 0\noom_kill 7\n"}, 7),
        ("4:memory:/x/y\n", {}, None),
    ],
)
def test_oom_kills_read_from_cgroup_v1_and_v2(tmp_path, proc, files, count):
    (tmp_path / "cgroup").write_text(proc)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    assert death_notes.oom_kills(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == count
