"""The Ray Data engine on a local Ray cluster (no GPUs: CPU actors) finishes a batch that a local
run began: it makes only the missing images, and they are the ones the local engine makes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.generation import generate as gen
from tests.tasks.tiny_weights import write_tiny_weights

pytestmark = pytest.mark.slow

PROMPTS = ["a red cat", "a castle on a hill", "a bowl of fruit"]
SEEDS = [5, 6]
SETTINGS = gen.Settings(num_steps=4)


def test_ray_data_finishes_a_batch_begun_locally(tmp_path):
    import ray

    from tasks.generation.generate_ray import generate_images_on_ray

    run_dir = write_tiny_weights(tmp_path / "run")
    out, clean = tmp_path / "out", tmp_path / "clean"
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        begun = gen.generate_images(run_dir, PROMPTS[:1], SEEDS, out, settings=SETTINGS)
        reference = gen.generate_images(run_dir, PROMPTS, SEEDS, clean, settings=SETTINGS)
    finally:
        torch.set_num_threads(previous)
    before = {f: (out / f).stat().st_mtime_ns for f in begun["file"].to_pylist()}

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        calls = []
        index = generate_images_on_ray(
            run_dir, PROMPTS, SEEDS, out, num_workers=1, settings=SETTINGS,
            batch_size=2, on_progress=lambda done, total: calls.append((done, total)),
        )  # fmt: skip
    finally:
        ray.shutdown()

    assert calls[0] == (2, 6) and calls[-1] == (6, 6)
    assert all((out / f).stat().st_mtime_ns == t for f, t in before.items())
    assert index.drop_columns(["seconds"]).equals(reference.drop_columns(["seconds"]))
    for name in index["file"].to_pylist():
        a = np.asarray(Image.open(out / name)).astype(np.int16)
        b = np.asarray(Image.open(clean / name)).astype(np.int16)
        assert np.abs(a - b).max() <= 2, name
