"""The keep policy keeps the checkpoint an eval metric chose (`best-by-<metric>`, pointed by
`sdpipe eval --checkpoints`), as it keeps `best`; without it the rolling policy keeps only the
latest."""

from __future__ import annotations

import torch

from sdtrain.checkpoint import CheckpointDir, KeepPolicy
from sdtrain.config import TrainConfig


def test_the_checkpoint_an_eval_metric_chose_outlives_the_rolling_latest(tmp_path):
    config = TrainConfig(
        phase="demo", phase_dir=str(tmp_path), run_dir=str(tmp_path), model="tiny", lr=1e-3,
        warmup_steps=0, epochs=1, batch_size=1, cfg_dropout=0.0, min_snr_gamma=5.0,
    )  # fmt: skip
    weights = {"w": torch.zeros(2)}
    policy = KeepPolicy(checkpoint_every=1, keep_every=0)
    checkpoints = CheckpointDir(tmp_path / "checkpoints", policy)
    for step in (1, 2):
        checkpoints.save(step, unet=weights, unet_ema=weights, config=config)
    assert checkpoints.steps() == [2]
    checkpoints.point_best(2, "clip_score")
    for step in (3, 4):
        checkpoints.save(step, unet=weights, unet_ema=weights, config=config)
    assert checkpoints.steps() == [2, 4]
    assert checkpoints.best("clip_score") == checkpoints.step_dir(2).resolve()
    assert checkpoints.best() is None  # the validation-loss link is another one
    assert policy.to_keep([1, 2, 3], latest=3, best=None) == {3}
    assert policy.to_keep([1, 2, 3], latest=3, best=None, best_by_metric={1}) == {1, 3}
