"""Issue 28: every batch shape a run will see is run once before step 1 (`runtime.warm_up`), so
torch.compile's graphs and cuDNN's autotuning are paid up front, not in each bucket's first steps;
the warm-up changes no step. A compiled run (`compile: true`) takes the eager run's steps within
a tolerance (`gpu`: compiling the tiny UNet on this 2-core CPU took 95 s).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from sdtrain.bucket_batches import warm_up_batches
from sdtrain.data import BucketBatchSampler, PhaseSet, collate, split_rows
from sdtrain.monitor import read_log
from tests.torch_threads import one_torch_thread


def logged(run_dir) -> list[dict]:
    return [r for r in read_log(Path(run_dir) / "log.jsonl") if "loss" in r]


@pytest.mark.parametrize("world_size", [1, 2])
def test_warm_up_batches_are_the_first_of_each_shape_the_sampler_gives(
    bucketed_phase_dir, world_size
):
    """One batch per (bucket, rows on this rank), the bucket's last short or long batch
    included, with the rows the rank's loader gives first for that shape, as it collates them."""
    data = PhaseSet(bucketed_phase_dir, seed=0, flip_p=0.5)
    rows, _ = split_rows(len(data), 4, seed=0)
    for rank in range(world_size):
        sampler = BucketBatchSampler(
            rows,
            data.bucket_of_row[rows],
            data.bucket_names,
            batch_size=8 // world_size,
            seed=0,
            rank=rank,
            world_size=world_size,
        )
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate)
        first: dict[tuple, list] = {}
        for batch in sampler:  # the epoch's batches, as the loader takes them
            shape = (int(data.bucket_of_row[batch[0][0]]), len(batch))
            first.setdefault(shape, [r for r, _ in batch])
        assert len({n for _, n in first}) > 1  # the set has a bucket with a short/long batch
        warm = list(warm_up_batches(loader, data, sampler))
        assert [b[2].tolist() for b in warm] == list(first.values())
        for latents, ids, batch_rows in warm:
            expected = collate([data[int(r), 0] for r in batch_rows])
            torch.testing.assert_close(latents, expected[0], rtol=0, atol=0)
            assert torch.equal(ids, expected[1])


def test_the_unbucketed_warm_up_is_the_loaders_first_batch_size(phase_dir):
    data = PhaseSet(phase_dir)
    loader = DataLoader(torch.utils.data.Subset(data, np.arange(5, 20)), batch_size=4)
    ((latents, ids, rows),) = warm_up_batches(loader)
    assert rows.tolist() == [5, 6, 7, 8] and latents.shape[0] == 4 and ids.shape == (4, 77)


def test_a_run_warmed_up_takes_the_same_steps(
    bucketed_one_rank_run, make_bucketed_config, tmp_path
):
    """The bucketed run of the fixture (no warm-up on the CPU) and the same run with every shape
    warmed up first: the same losses and gradient norms, bit for bit."""
    from sdtrain.train import train

    reference, _ = bucketed_one_rank_run
    config = make_bucketed_config(tmp_path, sample_every=0, warm_up=True)
    with one_torch_thread():
        summary = train(config)
    assert summary["warm_up"]["compile"] is False
    assert summary["warm_up"]["shapes"] >= 3  # two buckets, one with its short batch or more
    assert summary["warm_up"]["seconds"] > 0
    got, expected = logged(tmp_path), logged(reference.run_dir)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in expected
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_compiled_run_on_a_gpu_takes_the_eager_steps(make_config, tmp_path):
    """The same run compiled and eager, on a GPU (bf16 autocast): losses within 2%."""
    from sdtrain.train import train

    runs = {}
    for compiled in (False, True):
        config = make_config(
            tmp_path / str(compiled), sample_every=0, compile=compiled, deterministic=False
        )
        summary = train(config)
        assert summary["warm_up"]["compile"] is compiled and summary["warm_up"]["shapes"] == 1
        runs[compiled] = [r["loss"] for r in logged(tmp_path / str(compiled))]
    np.testing.assert_allclose(runs[True], runs[False], rtol=2e-2)
