"""Two devices split a batch; SIGKILL its coordinator mid-way: the workers die with it, and the
rerun makes only the missing images, which then equal an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.generation import generate as gen
from tests.tasks.tiny_weights import write_tiny_weights

pytestmark = pytest.mark.slow

PROMPTS = [f"a photo of object {i}" for i in range(5)]
SEEDS = [0, 1, 2, 3]
SETTINGS = gen.Settings(num_steps=6)
BATCH = 2  # 20 images in 10 chunks, 5 per device
GENERATE = f"""
import sys
from tasks.generation.generate import Settings, generate_images
generate_images(sys.argv[1], {PROMPTS!r}, {SEEDS!r}, sys.argv[2], devices=["cpu:0", "cpu:1"],
                settings=Settings(num_steps={SETTINGS.num_steps}), batch_size={BATCH})
"""


def workers_of(pid: int) -> list[int]:
    """The spawned worker processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def listing(out: Path) -> set[str]:
    return set(os.listdir(out)) | {f"parts/{n}" for n in os.listdir(out / gen.PARTS)}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigkill_mid_batch_then_rerun(tmp_path):
    run_dir = write_tiny_weights(tmp_path / "run")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", GENERATE, str(run_dir), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    # Kill once both devices have finished a chunk (each chunk record names its worker's pid).
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        records = list((out / gen.PARTS).glob("*.parquet"))
        if len({p.name.split(".")[-2] for p in records}) == 2:
            break
        assert proc.poll() is None, "the batch ended before the kill"
        time.sleep(0.01)
    workers = workers_of(proc.pid)
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = listing(out)
    deadline = time.monotonic() + 30
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, workers)), "a worker outlived its killed coordinator"
    # They died with it, mid-chunk, rather than finishing a chunk no one would record.
    assert listing(out) == at_kill

    made_before = {p.name: p.stat() for p in out.glob("*.png")}
    total = len(PROMPTS) * len(SEEDS)
    assert 2 * BATCH <= len(made_before) < total  # the kill landed mid-batch
    assert not (out / gen.INDEX).exists()

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calls = []
        index = gen.generate_images(
            run_dir, PROMPTS, SEEDS, out, devices=["cpu"], settings=SETTINGS, batch_size=BATCH,
            on_progress=lambda done, n: calls.append(done),
        )  # fmt: skip
        reference = gen.generate_images(
            run_dir, PROMPTS, SEEDS, tmp_path / "clean", devices=["cpu"], settings=SETTINGS
        )
    finally:
        torch.set_num_threads(previous)

    # Only the missing images were made; the killed run's are untouched, none half-written.
    assert calls[0] == len(made_before) and calls[-1] == total
    for name, st in made_before.items():
        now = (out / name).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert not [p for p in os.listdir(out) if ".tmp-" in p]
    rows = index.to_pylist()
    assert len(rows) == total and len({r["file"] for r in rows}) == total

    # The two devices split the killed run's work; the rerun made the rest here.
    by_device: dict[str | None, set[str]] = {}
    for r in rows:
        by_device.setdefault(r["device"], set()).add(r["file"])
    assert by_device["cpu:0"] and by_device["cpu:1"]
    assert by_device["cpu"] == set(index["file"].to_pylist()) - set(made_before)
    assert set(by_device) <= {"cpu:0", "cpu:1", "cpu", None}  # None: killed before its record

    # Split, killed and resumed, the batch is the uninterrupted one.
    assert reference["file"].to_pylist() == index["file"].to_pylist()
    for name in index["file"].to_pylist():
        a = np.asarray(Image.open(out / name)).astype(np.int16)
        b = np.asarray(Image.open(tmp_path / "clean" / name)).astype(np.int16)
        assert np.abs(a - b).max() <= 2, name
