"""Issue 33.9: the checks that a phase set's sources are as mixed. A file rewritten in place with
its mtime put back (`cp -p`) is digested (its ctime moved) and refused; a file the set maps after
its open is checked when mapped; a chmod or hard link (a ctime alone) is digested and passes."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sdtrain import fingerprints, layout
from sdtrain.data import PhaseSet
from tests.sdtrain.conftest import NUM_ROWS_PER_SHARD, SHARDS


def write_arrow(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def own_set(phase_dir: Path, dest: Path) -> Path:
    """The session's phase set with source files of its own (its links re-pointed to copies),
    a keys file beside each shard's latents, and its sources recorded as mix records them."""
    phase, src = dest / "phase", dest / "src"
    shutil.copytree(phase_dir, phase, symlinks=True)
    src.mkdir()
    for link in [*(phase / "latents").iterdir(), *(phase / "tokens").iterdir()]:
        copy = src / link.resolve().name
        shutil.copyfile(link.resolve(), copy)
        link.unlink()
        link.symlink_to(copy)
    n = NUM_ROWS_PER_SHARD
    for shard in SHARDS:  # latent row i is key i; its token row is n - 1 - i
        keys = [f"demo/{shard}/{i:04d}" for i in range(n)]
        token_rows = pa.array(range(n - 1, -1, -1), pa.int32())
        write_arrow(
            src / f"latents-{shard}.keys.arrow", pa.table({"key": keys, "token_row": token_rows})
        )
    meta = json.loads((phase / layout.FILES).read_text())
    meta[fingerprints.FIELD] = fingerprints.record(phase, [f["name"] for f in meta["files"]])
    (phase / layout.FILES).write_text(json.dumps(meta))
    return phase


def count_digests(monkeypatch) -> list[tuple[str, ...]]:
    """The columns of every digest the fingerprints compute from now on."""
    digested: list[tuple[str, ...]] = []
    real = fingerprints.column_digest

    def counted(table: pa.Table, columns: tuple[str, ...]) -> str:
        digested.append(columns)
        return real(table, columns)

    monkeypatch.setattr(fingerprints, "column_digest", counted)
    return digested


def clock_past(path: Path) -> None:
    """Until the filesystem's clock is past `path`'s ctime: a ctime has its grain (a tick of
    the kernel's coarse clock), and a change within the tick of the last one keeps it."""
    probe = path.with_name("clock-probe")
    probe.touch()
    while os.stat(probe).st_ctime_ns <= os.stat(path).st_ctime_ns:
        os.utime(probe)
    probe.unlink()


def items(data: PhaseSet) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [data[i][:2] for i in range(len(data))]


def test_a_keys_file_rewritten_in_place_with_its_mtime_put_back_is_refused(phase_dir, tmp_path):
    """`cp -p` onto the file: the same inode, size and mtime, other rows; only its ctime moved."""
    phase = own_set(phase_dir, tmp_path)
    keys = tmp_path / "src" / "latents-00001.keys.arrow"
    table = pa.ipc.open_file(pa.memory_map(str(keys))).read_all()
    other = tmp_path / "other.keys.arrow"
    write_arrow(other, table.take(list(range(table.num_rows))[::-1]))
    subprocess.run(["touch", "-r", keys, other], check=True)
    clock_past(keys)
    before = keys.stat()
    subprocess.run(["cp", "-p", other, keys], check=True)
    after = keys.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    with pytest.raises(fingerprints.StalePhaseSet, match=r"latents-00001\.keys\.arrow changed"):
        PhaseSet(phase)


def replace(path: Path, write) -> None:
    """A source file rewritten as sdpipe does: a temporary name renamed into place."""
    tmp = path.with_name(f".tmp-{path.name}")
    write(tmp)
    os.replace(tmp, path)


@pytest.mark.parametrize("stage", ["tokenize", "encode"])
def test_a_source_rewritten_between_open_and_map_is_refused_when_mapped(phase_dir, tmp_path, stage):
    """The set opens (its sources as mixed), then shard 00001 is re-tokenized or re-encoded with
    its rows in another order before any row of it is read: its first read refuses the set."""
    phase = own_set(phase_dir, tmp_path)
    src = tmp_path / "src"
    data = PhaseSet(phase)
    first = data[0][:2]
    rolled = np.roll(np.arange(NUM_ROWS_PER_SHARD), 1)
    if stage == "tokenize":
        table = pq.read_table(src / "tokens-00001.parquet").take(rolled)
        ids = np.load(src / "tokens-00001.npy")[rolled]
        replace(src / "tokens-00001.parquet", lambda p: pq.write_table(table, p))
        replace(src / "tokens-00001.npy", lambda p: np.save(p, ids))
        changed = r"tokens-00001\.parquet"
    else:
        keys = pa.ipc.open_file(pa.memory_map(str(src / "latents-00001.keys.arrow"))).read_all()
        latents = np.load(src / "latents-00001.npy")[rolled]
        replace(src / "latents-00001.npy", lambda p: np.save(p, latents))
        replace(src / "latents-00001.keys.arrow", lambda p: write_arrow(p, keys.take(rolled)))
        changed = r"latents-00001\.keys\.arrow"
    assert all(torch.equal(a, b) for a, b in zip(data[0][:2], first, strict=True))  # mapped before
    with pytest.raises(
        fingerprints.StalePhaseSet, match=rf"{changed} changed .*found when mapping"
    ):
        data[NUM_ROWS_PER_SHARD]


def test_a_chmod_or_a_hard_link_is_digested_and_passes(phase_dir, tmp_path, monkeypatch):
    """An unchanged set is trusted on stats alone, at its open and at each map; a ctime moved by
    a chmod or a hard link (a keep-aside's) costs a digest of the shard's keys or tokens, once,
    and the same rows are read."""
    phase = own_set(phase_dir, tmp_path)
    src = tmp_path / "src"
    digested = count_digests(monkeypatch)
    expected = items(PhaseSet(phase))
    assert digested == []

    clock_past(src / "tokens-00001.npy")
    os.chmod(src / "latents-00000.keys.arrow", 0o600)
    os.chmod(src / "tokens-00001.parquet", 0o600)
    os.link(src / "latents-00000.npy", src / "latents-00000.kept.npy")
    os.chmod(src / "tokens-00001.npy", 0o600)
    data = pickle.loads(pickle.dumps(PhaseSet(phase)))  # as a loader's worker gets it
    got = items(data)
    assert all(
        torch.equal(a, b)
        for pair, want in zip(got, expected, strict=True)
        for a, b in zip(pair, want, strict=True)
    )
    assert sorted(digested) == sorted([fingerprints.KEY_COLUMNS, ("key",)])


def test_a_set_mixed_before_ctime_was_recorded_is_checked_as_before(
    phase_dir, tmp_path, monkeypatch
):
    phase = own_set(phase_dir, tmp_path)
    meta = json.loads((phase / layout.FILES).read_text())
    for shard in meta[fingerprints.FIELD].values():
        shard["keys_stat"], shard["tokens_stat"] = shard["keys_stat"][:3], shard["tokens_stat"][:3]
    (phase / layout.FILES).write_text(json.dumps(meta))
    (phase / fingerprints.MAPPED).unlink()
    digested = count_digests(monkeypatch)
    os.chmod(tmp_path / "src" / "latents-00000.npy", 0o600)
    assert len(items(PhaseSet(phase))) == 2 * NUM_ROWS_PER_SHARD
    assert digested == []


def test_a_set_indexed_from_its_manifest_checks_each_file_against_its_own_record(
    phase_dir, tmp_path, monkeypatch
):
    """A manifest rewritten since the mix (its rows of shard 00001 only) is indexed anew, its
    files in another order than the record's: each is still checked against its own."""
    phase = own_set(phase_dir, tmp_path)
    manifest = pq.read_table(phase / layout.MANIFEST)
    pq.write_table(manifest.slice(NUM_ROWS_PER_SHARD), phase / layout.MANIFEST)
    data = PhaseSet(phase)
    looked_up = []  # a file mapped that is not the one recorded looks up its shard's keys file
    real = fingerprints.keys_path
    monkeypatch.setattr(fingerprints, "keys_path", lambda *a: looked_up.append(a) or real(*a))
    assert data.names == ["demo-00001"] and len(items(data)) == NUM_ROWS_PER_SHARD
    assert looked_up == []
