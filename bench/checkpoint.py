"""Checkpoint write and resume-read time at SD1.5 size: what a cancel has to fit in.

The state is what the trainer saves: live UNet + EMA (fp32, 859.5M parameters each, shapes of
SD1.5's UNet) and AdamW's two moments, written by `sdtrain.checkpoint.CheckpointDir.save`
(files, checksums, fsync, rename) to a folder on the disk under test; then read back as a
resume reads it (checksums verified, trainer state loaded). Prints one JSON object.
Usage: python bench/checkpoint.py [--dir PATH] [--scale 1.0] [--repeats 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import platform
import shutil
import tempfile
import time

import torch

from catalog.loader import PACKAGED_DIR, load_catalog
from sdtrain.checkpoint import CheckpointDir, KeepPolicy, read_trainer_state
from sdtrain.config import TrainConfig


def unet_shapes(scale: float) -> dict[str, torch.Size]:
    """SD1.5's UNet parameter shapes (built on the meta device: no memory), the largest first
    dimension scaled by `scale` for a smaller run."""
    from diffusers import UNet2DConditionModel

    config = load_catalog(PACKAGED_DIR).model("sd15").unet_config
    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    shapes = {}
    for name, p in unet.named_parameters():
        shape = list(p.shape)
        shape[0] = max(1, round(shape[0] * scale))
        shapes[name] = torch.Size(shape)
    return shapes


def trainer_state(params: list[torch.Tensor]) -> dict:
    """The trainer's resumable state with AdamW moments for `params` (values do not matter)."""
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        optimizer.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return {
        "step": 1,
        "epoch": 0,
        "samples_done": 96,
        "best_val_loss": float("inf"),
        "optimizer": optimizer.state_dict(),
        "lr_schedule": {"last_epoch": 1},
        "scaler": {},
        "rng": [{"torch": torch.get_rng_state()}],
        "run_shape": {"total_steps": 10},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="folder on the disk to test")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of SD1.5's size")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    shapes = unet_shapes(args.scale)
    live = {n: torch.zeros(s) for n, s in shapes.items()}
    ema = {n: t.clone() for n, t in live.items()}
    trainer = trainer_state(list(live.values()))
    num_params = sum(t.numel() for t in live.values())
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="sdpipe-ckpt-bench-"))
    config = TrainConfig(
        phase="bench",
        phase_dir=str(work),
        run_dir=str(work),
        model="sd15",
        lr=1e-5,
        warmup_steps=0,
        epochs=1,
        batch_size=1,
        cfg_dropout=0.0,
        min_snr_gamma=5.0,
    )
    writes = []
    try:
        checkpoints = CheckpointDir(
            work / "checkpoints", KeepPolicy(checkpoint_every=1, keep_every=0)
        )
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            directory = checkpoints.save(
                step, unet=live, unet_ema=ema, config=config, trainer=trainer, ema_step=step
            )
            writes.append(time.perf_counter() - start)
        size = sum(p.stat().st_size for p in directory.iterdir())
        del live, ema, trainer  # the read below holds the moments again
        start = time.perf_counter()
        read_trainer_state(directory, torch.device("cpu"))
        read_seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "machine": platform.node(),
                "num_params": num_params,
                "gigabytes": round(size / 1e9, 2),
                "write_seconds": round(min(writes), 2),
                "write_gb_per_s": round(size / 1e9 / min(writes), 2),
                "resume_read_seconds": round(read_seconds, 2),
                # torchrun's wait after a SIGTERM before it kills the ranks (TrainConfig)
                "stop_grace_seconds": config.stop_grace_s,
                "fits_grace": min(writes) < config.stop_grace_s,
            }
        )
    )


if __name__ == "__main__":
    main()
