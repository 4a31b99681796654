"""Bucketed phase sets as the trainer reads them: batches of one bucket, every row once per
epoch over the ranks, small buckets left out under their reason, flips and latent draws seeded
per (seed, epoch, row) (docs/training-data.md "The sampler")."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from sdtrain import layout
from sdtrain.bucket_batches import SMALL_BUCKET, bucketed_batches
from sdtrain.data import (
    BucketBatchSampler,
    PhaseSet,
    collate,
    flipped,
    split_rows,
)
from sdtrain.models import tokenize
from sdtrain.objective import LATENT_STREAM

from .conftest import BUCKETED_FILES, bucket_latents, caption, write_phase_set


def stored_latents(phase_dir) -> np.ndarray:
    """Each manifest row's stored latents [V, C, h, w], in row order."""
    out = []
    for name, *_ in BUCKETED_FILES:
        out.extend(np.load(phase_dir / "latents" / f"{name}.npy"))
    return out


@pytest.mark.parametrize(
    ("counts", "global_batch", "world_size", "expected"),
    [
        ([16], 8, 2, 2),  # whole batches only
        ([20], 8, 2, 3),  # 4 left: a short batch of 2 + 2
        ([9], 8, 2, 1),  # 1 left, fewer than the ranks: sits the epoch out
        ([9], 8, 1, 2),  # ... but one rank takes it on its own
        ([7], 8, 2, 0),  # fewer than a global batch: left out
        ([11, 12], 8, 4, 1 + 2),  # 3 left of 4 ranks: sit out; 4 left: a batch of 1 each
        ([], 8, 2, 0),
        ([16, 20, 9, 7, 0], 8, 2, 2 + 3 + 1),
    ],
)
def test_bucketed_batches_counts_as_the_sampler_cuts(counts, global_batch, world_size, expected):
    assert bucketed_batches(counts, global_batch, world_size) == expected
    buckets = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    rows = np.arange(len(buckets), dtype=np.int32)
    names = [f"{64 * (b + 1)}x64" for b in range(len(counts))]
    batch_size = global_batch // world_size
    for rank in range(world_size):
        sampler = BucketBatchSampler(
            rows, buckets, names, batch_size=batch_size, seed=0, rank=rank, world_size=world_size
        )
        assert len(sampler) == len(list(sampler)) == expected


def epoch_of(sampler_per_rank: list[BucketBatchSampler], epoch: int) -> list[list[list]]:
    for sampler in sampler_per_rank:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in sampler_per_rank]


def test_batches_hold_one_bucket_and_every_row_comes_once_per_epoch_over_two_ranks():
    # Buckets of 20 (3 batches of 6 and one of 2: 1 + 1), 13 (2 batches of 6; the 1 left sits
    # the epoch out: joined, it gave a rank 4 rows at batch_size 3), 5 (fewer than a global
    # batch of 6: left out) and 6 (one batch) training rows.
    counts = {"512x512": 20, "576x448": 13, "448x576": 5, "640x384": 6}
    names = sorted(counts)
    rng = np.random.default_rng(0)
    buckets = rng.permutation(np.repeat(np.arange(4, dtype=np.int32), [counts[n] for n in names]))
    rows = np.sort(rng.choice(1000, len(buckets), replace=False)).astype(np.int32)
    bucket_of = dict(zip(rows.tolist(), buckets.tolist(), strict=True))
    samplers = [
        BucketBatchSampler(rows, buckets, names, batch_size=3, seed=7, rank=r, world_size=2)
        for r in (0, 1)
    ]
    assert samplers[0].left_out == {"448x576": 5} and SMALL_BUCKET == "small_bucket"
    assert samplers[0].buckets == {"512x512": 20, "576x448": 13, "640x384": 6}
    kept = sorted(r for r, b in bucket_of.items() if names[b] != "448x576")

    orders = []
    for epoch in (0, 1):
        rank_0, rank_1 = epoch_of(samplers, epoch)
        assert len(rank_0) == len(rank_1) == len(samplers[0]) == 4 + 2 + 1  # same step count
        seen = []
        for mine, theirs in zip(rank_0, rank_1, strict=True):
            assert mine and theirs and abs(len(mine) - len(theirs)) <= 1  # split evenly
            assert {e for _, e in mine + theirs} == {epoch}  # items carry their epoch
            global_batch = [r for r, _ in mine + theirs]
            assert len({bucket_of[r] for r in global_batch}) == 1  # one bucket
            assert len(global_batch) in (6, 2)  # full, short of its own
            seen += global_batch
        # Every row once but the 13-row bucket's leftover, ranks disjoint, small bucket out.
        assert len(seen) == len(set(seen)) == len(kept) - 1 and set(seen) <= set(kept)
        assert samplers[0].leftover_per_epoch == 1
        assert [len(b) for b in rank_0].count(3) >= 4  # full batches: batch_size each
        orders.append(seen)
    assert orders[0] != orders[1]  # a new order each epoch
    again = epoch_of(
        [
            BucketBatchSampler(rows, buckets, names, batch_size=3, seed=7, rank=r, world_size=2)
            for r in (0, 1)
        ],
        1,
    )
    assert [r for b0, b1 in zip(*again, strict=True) for r, _ in b0 + b1] == orders[1]

    # A started epoch: the remaining batches, in the same order.
    samplers[1].set_epoch(1, 3)
    assert list(samplers[1]) == epoch_of(samplers, 1)[1][3:]
    samplers[1].set_epoch(1, 3)
    assert len(samplers[1]) == 7 - 3


def test_the_bucketed_set_names_each_rows_bucket(bucketed_phase_dir, phase_dir):
    data = PhaseSet(bucketed_phase_dir)
    assert data.bucket_names == ["48x80", "64x64", "80x48"]
    expected = np.repeat([1, 1, 2, 0], [n for _, n, *_ in BUCKETED_FILES])
    assert data.bucket_of_row.dtype == np.int32
    assert data.bucket_of_row.tolist() == expected.tolist()
    assert data.bucketed  # several buckets
    assert [data[r][0].shape for r in (0, 12, 22, 37)] == [(4, 8, 8)] * 2 + [(4, 6, 10), (4, 10, 6)]
    legacy = PhaseSet(phase_dir)  # no bucket in files.json: from the latents' shape
    assert legacy.bucket_names == ["64x64"] and not legacy.bucketed
    assert legacy.file_views.tolist() == [1, 1] and legacy.file_channels.tolist() == [4, 4]
    with pytest.raises(ValueError, match=r"demo asks flip_p but its latents hold no mirrored "
                       r"view .*encode the source again \(flips are encoded when a phase mixing "
                       r"it has flip_p > 0\)"):  # fmt: skip
        PhaseSet(phase_dir, flip_p=0.5, name="demo")

    # Training rows per bucket at a global batch of 8: 48x80 is too small.
    train_rows, _ = split_rows(len(data), 4, 0)
    sampler = BucketBatchSampler(
        train_rows, data.bucket_of_row[train_rows], data.bucket_names, batch_size=8, seed=0
    )
    assert sampler.left_out == {"48x80": 2} and sampler.buckets == {"64x64": 20, "80x48": 14}
    assert len(sampler) == 5


def test_rows_are_flipped_per_seed_epoch_and_row_at_flip_p(bucketed_phase_dir):
    draws = np.array([[flipped(5, e, r, 0.3) for r in range(40)] for e in range(50)])
    assert abs(draws.mean() - 0.3) < 0.04  # about flip_p of the rows
    assert (draws != draws[0]).any(axis=1).sum() > 40  # another choice each epoch
    assert not any(flipped(5, e, r, 0.0) for e in range(5) for r in range(40))
    assert draws.tolist() == [[flipped(5, e, r, 0.3) for r in range(40)] for e in range(50)]

    data = PhaseSet(bucketed_phase_dir, seed=5, flip_p=0.3, sample_latents=False)
    stored = stored_latents(bucketed_phase_dir)
    for epoch in range(3):
        for row in range(40):
            view = int(draws[epoch, row])
            latent, ids, got_row = data[row, epoch]
            assert got_row == row and ids.dtype == torch.int64
            assert torch.equal(latent, torch.from_numpy(stored[row][view, :4].astype(np.float32)))
    latent = data[3][0]  # validation's read: never flipped
    assert torch.equal(latent, torch.from_numpy(stored[3][0, :4].astype(np.float32)))
    # Another set of the same phase, seed and flip_p: the same choice.
    other = PhaseSet(bucketed_phase_dir, seed=5, flip_p=0.3, sample_latents=False)
    assert all(torch.equal(data[r, 2][0], other[r, 2][0]) for r in range(40))


def test_latents_are_drawn_from_the_posterior_per_epoch_and_row(bucketed_phase_dir):
    stored = stored_latents(bucketed_phase_dir)
    channels = [c for _, n, _, _, c in BUCKETED_FILES for _ in range(n)]
    means = PhaseSet(bucketed_phase_dir, seed=3, sample_latents=False)
    assert means.bucketed  # buckets; a one-bucket set would be bucketed by its draws alone
    drawn = PhaseSet(bucketed_phase_dir, seed=3)
    assert drawn.draws_latents and not means.draws_latents
    for row in (0, 12, 21, 25):
        mean = stored[row][0, :4].astype(np.float32)
        assert torch.equal(means[row, 4][0], torch.from_numpy(mean))
        assert torch.equal(drawn[row][0], torch.from_numpy(mean))  # validation: the mean
        latent = drawn[row, 4][0]
        if channels[row] == 4:  # no log-variance: the mean
            assert torch.equal(latent, torch.from_numpy(mean))
            continue
        eps = np.random.default_rng((3, LATENT_STREAM, 4, row)).standard_normal(
            mean.shape, dtype=np.float32
        )
        std = np.exp(stored[row][0, 4:].astype(np.float32) / 2)
        assert torch.equal(latent, torch.from_numpy(mean + std * eps))
        assert 0.05 < float((latent - torch.from_numpy(mean)).std()) < 0.2  # std ~ 0.1
        assert torch.equal(PhaseSet(bucketed_phase_dir, seed=3)[row, 4][0], latent)
        assert not torch.equal(drawn[row, 5][0], latent)  # a new draw each epoch


def test_a_bucketed_set_in_ram_reads_what_the_mapped_one_does(bucketed_phase_dir):
    for flip_p, sample in ((0.5, True), (0.0, False), (0.5, False)):
        mapped = PhaseSet(bucketed_phase_dir, seed=1, flip_p=flip_p, sample_latents=sample)
        in_ram = PhaseSet(
            bucketed_phase_dir, seed=1, flip_p=flip_p, sample_latents=sample, in_ram=True
        )
        assert len(in_ram.latents) == 3  # an array per bucket
        assert all(layout.mapped_file(a) is None for a in in_ram.latents)
        for key in [*range(40), *((r, e) for r in range(40) for e in (0, 1))]:
            a, b = mapped[key], in_ram[key]
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_a_latents_file_of_another_shape_than_the_index_says_fails_naming_it(
    bucketed_phase_dir, tmp_path
):
    moved = tmp_path / "moved"
    shutil.copytree(bucketed_phase_dir, moved)
    meta = json.loads((moved / layout.FILES).read_text())
    meta["files"][2]["channels"] = 4  # 80x48's file holds 8
    (moved / layout.FILES).write_text(json.dumps(meta))
    data = PhaseSet(moved)
    data[0]
    with pytest.raises(ValueError, match=r"demo-00000.80x48.npy holds latents .* mix the phase"):
        data[22]


def test_a_set_of_legacy_and_bucketed_files_reads_both(tmp_path):
    """Files without bucket fields next to files with them: shapes from the headers."""
    rng = np.random.default_rng(2)
    legacy = (rng.standard_normal((4, 4, 8, 8))).astype(np.float16)
    bucketed = bucket_latents(rng, 3, 6, 10, channels=4)
    folder = write_phase_set(
        tmp_path / "p",
        [
            {"name": "a-00000", "latents": legacy},
            {"name": "b-00000.80x48", "latents": bucketed, "bucket": "80x48", "views": 2},
        ],
    )
    data = PhaseSet(folder)
    assert data.bucket_names == ["64x64", "80x48"]
    assert data.file_views.tolist() == [1, 2] and data.file_channels.tolist() == [4, 4]
    assert torch.equal(data[2, 0][0], torch.from_numpy(legacy[2].astype(np.float32)))
    assert torch.equal(data[5][0], torch.from_numpy(bucketed[1, 0].astype(np.float32)))
    assert torch.equal(data[5][1], tokenize([caption("00000", 1)])[0])
    with pytest.raises(ValueError, match=r"asks flip_p .* \(1 of 2 files, e.g. latents/a-00000"):
        PhaseSet(folder, flip_p=0.1)


def test_held_out_rows_of_several_buckets_are_scored_in_batches_of_one(bucketed_phase_dir):
    """The per-row validation losses (eval's bands): rows of three shapes, each row's loss as
    when it is scored alone, in the order asked."""
    from catalog import load_catalog
    from sdtrain.models import build_text_encoder, build_unet
    from sdtrain.validation import row_losses

    model = load_catalog().model("tiny")
    unet, text_encoder = build_unet(model, seed=0).eval(), build_text_encoder(model).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # a UNet whose output is not zero (the init zeroes its last layers)
        for p in unet.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    data = PhaseSet(bucketed_phase_dir)
    rows = np.array([39, 10, 29, 13, 0, 25])  # 48x80, 64x64, 80x48, 64x64, 64x64, 80x48
    settings = dict(seed=0, gamma=5.0, prediction_type="epsilon")
    batched = row_losses(unet, text_encoder, data, rows, batch_size=16, **settings)
    alone = [row_losses(unet, text_encoder, data, rows[i : i + 1], **settings) for i in range(6)]
    assert batched.rows.tolist() == rows.tolist()
    assert batched.timesteps.tolist() == [a.timesteps[0] for a in alone]
    np.testing.assert_allclose(batched.mse, [a.mse[0] for a in alone], rtol=1e-5)
    assert len(set(batched.mse.tolist())) == 6


def test_a_phase_set_with_train_time_captions_reads_the_epochs_ids(tmp_path, bucketed_phase_dir):
    """Train-time captions plug into the rows the sampler gives (row, epoch); a row read
    without an epoch (validation, evaluation) keeps the ids the tokenize stage stored."""
    import shutil

    import pyarrow as pa

    from sdtrain.captions import CAPTIONS, CaptionSettings, TrainTimeCaptions

    phase = tmp_path / "phase"
    shutil.copytree(bucketed_phase_dir, phase, symlinks=True)
    num_rows = len(PhaseSet(phase))
    tags = [[f"row{i}, red, blue, green, sky", f"another caption {i}"] for i in range(num_rows)]
    table = pa.table({"captions": pa.array(tags, pa.list_(pa.string()))})
    with pa.OSFile(str(phase / CAPTIONS), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    captions = TrainTimeCaptions(phase, CaptionSettings(shuffle_tags_p=1.0, keep_tokens=1), 3)
    data = PhaseSet(phase, seed=3, captions=captions)
    plain = PhaseSet(phase, seed=3)
    assert data.bucketed  # the epoch must reach the row: the bucketed sampler gives it
    rows = np.flatnonzero(data.bucket_of_row == data.bucket_of_row[-1])[:3].tolist()  # one bucket
    latents, ids, got = collate([data[row, 2] for row in rows])  # the loader's batch
    assert ids.dtype == torch.int64 and got.tolist() == rows
    assert ids.tolist() == [captions.ids(row, 2).tolist() for row in rows]
    assert latents.shape[0] == 3
    for row in rows:
        assert data[row][1].tolist() == plain[row][1].tolist()  # no epoch: the stored ids
    epochs = {tuple(collate([data[5, e]])[1][0].tolist()) for e in range(6)}
    assert len(epochs) > 1  # another caption, or another tag order, per epoch


def test_a_set_holds_at_most_max_open_maps_and_reads_the_same_rows(bucketed_phase_dir):
    """A bucketed set of 10,000 shards has some 200,000 latents files, past a process's map
    limit: past `max_open` the least recently used map is let go and mapped again on use."""
    import pickle

    from sdtrain import data as data_module

    wide = PhaseSet(bucketed_phase_dir)
    expected = [wide[row][0].numpy() for row in range(len(wide))]
    narrow = PhaseSet(bucketed_phase_dir)
    for mapped in (narrow.latents, narrow.tokens):
        mapped.max_open = 2
    order = np.random.default_rng(0).permutation(len(narrow)).tolist() * 2
    for row in order:
        np.testing.assert_array_equal(narrow[row][0].numpy(), expected[row])
        held = sum(a is not None for a in narrow.latents.arrays)
        assert held <= 2 and len(narrow.latents.open) == held
    assert len(narrow.latents.arrays) == 4  # four files, read through two maps
    again = pickle.loads(pickle.dumps(narrow.latents))  # a loader worker's copy
    np.testing.assert_array_equal(again[0][0], narrow.latents[0][0])
    assert data_module.default_max_open() >= 64


@pytest.mark.parametrize(
    ("counts", "batch_size", "world_size"),
    [([36], 4, 8), ([9, 13, 70], 4, 2), ([13, 20], 3, 2), ([11, 12], 2, 4), ([9], 1, 8)],
)
def test_no_rank_ever_gets_more_than_batch_size_rows(counts, batch_size, world_size):
    """Issue 26: 36 rows at batch 4 on 8 ranks gave 5,5,5,5,4,4,4,4 (the 4 left over joined
    the previous batch). Leftover rows fewer than the ranks sit the epoch out instead: each
    epoch's permutation leaves out other rows, at most world_size - 1 per bucket, counted; the
    step count stays the one `sdpipe plan` counts."""
    buckets = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    rows = np.arange(len(buckets), dtype=np.int32)
    names = [f"{64 * (b + 1)}x64" for b in range(len(counts))]
    samplers = [
        BucketBatchSampler(
            rows, buckets, names, batch_size=batch_size, seed=3, rank=r, world_size=world_size
        )
        for r in range(world_size)
    ]
    global_batch = batch_size * world_size
    rest = [(c, c % global_batch) for c in counts]
    short = sum(r for c, r in rest if c >= global_batch and r < world_size)
    assert samplers[0].leftover_per_epoch == short
    dropped = []
    for epoch in range(3):
        per_rank = epoch_of(samplers, epoch)
        assert len({len(batches) for batches in per_rank}) == 1  # same step count on every rank
        assert len(per_rank[0]) == bucketed_batches(counts, global_batch, world_size)
        for step in zip(*per_rank, strict=True):
            assert all(1 <= len(b) <= batch_size for b in step), [len(b) for b in step]
        seen = [r for batches in per_rank for b in batches for r, _ in b]
        assert len(seen) == len(set(seen)) == len(rows) - short  # each at most once
        dropped.append(set(rows.tolist()) - set(seen))
    if short:
        assert len(set.union(*dropped)) > short  # another epoch leaves out other rows
