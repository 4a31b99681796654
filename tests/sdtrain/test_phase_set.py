"""The phase set as the ranks open it: an int32 row index and int32 token ids, memory-mapped and
shared through the page cache, widened to int64 only as a row is read; a folder without the
index (written by hand or an older sdpipe) gives the same rows from its manifest and parquets."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from sdtrain import layout
from sdtrain.data import EpochSampler, PhaseSet


def legacy_copy(phase_dir, dest):
    """The phase set as an older mix left it: manifest, latents and token parquets only."""
    shutil.copytree(phase_dir, dest, symlinks=True)
    for p in (dest / layout.ROWS, dest / layout.FILES, *(dest / "tokens").glob("*.npy")):
        p.unlink()
    return dest


def old_items(phase_dir) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row's (latent f32, ids i64) as the per-file int64 PhaseSet read them."""
    manifest = pq.read_table(phase_dir / "manifest.parquet").to_pylist()
    out = []
    for row in manifest:
        name = f"{row['source']}-{row['shard']}"
        latents = np.load(phase_dir / "latents" / f"{name}.npy")
        tokens = pq.read_table(phase_dir / "tokens" / f"{name}.parquet")
        ids = np.array(tokens["input_ids"].to_pylist(), np.int64)
        assert tokens["key"][row["token_row"]].as_py() == row["key"]
        out.append((latents[row["latent_row"]].astype(np.float32), ids[row["token_row"]]))
    return out


def open_data_files() -> set[str]:
    """The data files (arrays, tables) this process holds open. A count of every descriptor
    also moved with other threads of the test process (a pool of an earlier test closing its
    pipes made it 20 where 22 were before): only what a phase set could hold is looked at."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if path.endswith((".npy", ".parquet", ".arrow", ".json")):
            paths.add(path)
    return paths


def test_rows_and_token_ids_are_int32_memory_mapped(phase_dir):
    before = open_data_files()
    data = PhaseSet(phase_dir)
    assert open_data_files() == before  # mapped, no file held open per array
    assert data.rows.dtype == np.int32 and data.rows.shape == (len(data), 3)
    assert layout.mapped_file(data.rows) == str((phase_dir / layout.ROWS).resolve())
    for name, tokens, latents in zip(data.names, data.tokens, data.latents, strict=True):
        assert tokens.dtype == np.int32 and tokens.shape[1] == 77
        assert layout.mapped_file(tokens) == str((phase_dir / "tokens" / f"{name}.npy").resolve())
        assert layout.mapped_file(latents) == str((phase_dir / "latents" / f"{name}.npy").resolve())
    latent, ids, row = data[5]
    assert ids.dtype == torch.int64 and latent.dtype == torch.float32 and row == 5


def test_rows_are_the_ones_the_int64_phase_set_read(phase_dir, tmp_path):
    expected = old_items(phase_dir)
    legacy = PhaseSet(legacy_copy(phase_dir, tmp_path / "legacy"))
    assert layout.mapped_file(legacy.rows) is None  # derived from the manifest, in RAM
    assert all(layout.mapped_file(t) is None and t.dtype == np.int32 for t in legacy.tokens)
    for data in (PhaseSet(phase_dir), legacy, PhaseSet(phase_dir, in_ram=True)):
        assert len(data) == len(expected)
        for i, (latent, ids) in enumerate(expected):
            got_latent, got_ids, row = data[i]
            assert row == i
            assert torch.equal(got_latent, torch.from_numpy(latent))
            assert got_ids.dtype == torch.int64 and torch.equal(got_ids, torch.from_numpy(ids))


def test_a_rewritten_manifest_is_indexed_again_not_read_through_a_stale_index(phase_dir, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(phase_dir, moved, symlinks=True)
    manifest = pq.read_table(moved / "manifest.parquet")
    pq.write_table(manifest.slice(0, 20), moved / "manifest.parquet")  # 20 of 32 rows
    data = PhaseSet(moved)
    assert len(data) == 20 and layout.mapped_file(data.rows) is None
    assert all(
        torch.equal(a, b) for a, b in zip(data[7][:2], PhaseSet(phase_dir)[7][:2], strict=True)
    )
    # The same rows reversed (as the run-safety test does): a file of the same rows and size.
    pq.write_table(manifest.take(list(range(32))[::-1]), moved / "manifest.parquet")
    data, original = PhaseSet(moved), PhaseSet(phase_dir)
    assert layout.mapped_file(data.rows) is None
    assert all(torch.equal(a, b) for a, b in zip(data[0][:2], original[31][:2], strict=True))


def test_token_keys_that_differ_from_the_manifest_fail_on_the_parquet_path(phase_dir, tmp_path):
    legacy = legacy_copy(phase_dir, tmp_path / "legacy")
    manifest = pq.read_table(legacy / "manifest.parquet")
    keys = manifest["key"].to_pylist()
    keys[0], keys[1] = keys[1], keys[0]
    pq.write_table(manifest.set_column(5, "key", [keys]), legacy / "manifest.parquet")
    with pytest.raises(ValueError, match="keys differ from manifest"):
        PhaseSet(legacy)


def test_a_latents_file_shorter_than_the_manifest_reads_fails_naming_it(phase_dir, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(phase_dir, moved, symlinks=True)
    link = moved / "latents" / "demo-00001.npy"
    short = np.load(link)[:10]
    link.unlink()
    np.save(link, short)
    data = PhaseSet(moved)  # files are mapped (and checked) when first read
    data[3]
    with pytest.raises(ValueError, match=r"latents/demo-00001.npy has 10 rows.*mix the phase"):
        data[16 + 3]


@pytest.mark.parametrize("num_samples", [1000, 3_000_001])
def test_epoch_sampler_order_is_the_int64_permutation_of_seed_and_epoch(num_samples):
    """The sampler draws int32 and yields blocks of ints; the order is the one the int64
    permutation gave (a resume and every rank depend on it)."""
    sampler = EpochSampler(num_samples, seed=7, rank=1, world_size=3)
    sampler.set_epoch(2, start=99)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(9))
    order = order[: num_samples // 3 * 3]
    got = list(sampler)
    assert got == order[99:][1::3].tolist() and len(sampler) == len(got) == num_samples // 3 - 33
    assert all(type(i) is int for i in got[:10])


def test_a_latents_file_gone_fails_naming_it_when_its_rows_are_read(phase_dir, tmp_path):
    """The set still opens (its other files are read) when the first legacy file is gone: no
    header of it stands for the set's shape, and reading its rows names it."""
    moved = tmp_path / "moved"
    shutil.copytree(phase_dir, moved, symlinks=True)
    gone = moved / "latents" / "demo-00000.npy"
    gone.unlink()
    data = PhaseSet(moved)
    assert data.bucket_names == ["64x64"]
    np.testing.assert_array_equal(
        data[16][0].numpy(), np.load(phase_dir / "latents" / "demo-00001.npy")[0].astype(np.float32)
    )
    with pytest.raises(FileNotFoundError, match="demo-00000.npy"):
        data[0]


def test_a_set_whose_latents_are_all_gone_fails_at_open_naming_them(phase_dir, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(phase_dir, moved, symlinks=True)
    for p in (moved / "latents").glob("*.npy"):
        p.unlink()
    with pytest.raises(FileNotFoundError, match=r"latents: none of .* demo-00000.npy.*mix"):
        PhaseSet(moved)
