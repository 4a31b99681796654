"""Batch generation throughput: images/s of `tasks.generation.generate.generate_images` on the tiny
model.

The same batch (prompts x seeds, DDIM `--steps`, CFG 7.5, batch 8) on one device in this process
(torch's default threads, then one thread) and on N CPU twins (one spawned worker each, the
cores split among them), each into an empty folder, then a rerun over a finished folder
(nothing to make: planning + index). Weights: the tiny twin with random weights in a temporary
run folder. Prints one JSON object.
`--size full --device cuda`: SD1.5's architecture (random weights, in a temporary catalog as
bench/train.py writes it) on one GPU, DDIM `--steps` (50) with CFG at 512 px: images/s of
`generate_images` after a warm-up batch (issue 28 records it, without a goal).
Usage: python bench/generate.py [--images 64] [--steps 100] [--devices 2]
       python bench/generate.py --size full --device cuda [--images 64] [--steps 50]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from tasks.generation import generate as gen
from tests.tasks.tiny_weights import write_tiny_weights


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--device", default="cpu", help="full size: the one device")
    args = parser.parse_args()
    if args.size == "full":
        full_size(args)
        return

    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-generate-"))
    run_dir = write_tiny_weights(work / "run")
    num_prompts = max(1, args.images // 4)
    prompts = [f"a photo of object {i}, studio lighting" for i in range(num_prompts)]
    seeds = list(range(args.images // num_prompts))
    settings = gen.Settings(num_steps=args.steps)
    options = dict(settings=settings, batch_size=args.batch_size)
    twins = [f"cpu:{i}" for i in range(args.devices)]
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_1m_before": os.getloadavg()[0],
        "images": len(prompts) * len(seeds),
        "steps": args.steps,
        "batch_size": args.batch_size,
    }
    # Warm the imports and the networks' first call, which no measured run should pay.
    gen.generate_images(run_dir, prompts[:1], [0], work / "warm", devices=["cpu"], **options)
    default_threads = torch.get_num_threads()
    runs = (
        (f"one_device_{default_threads}_threads", ["cpu"], default_threads),
        ("one_device_1_thread", ["cpu"], 1),
        (f"{args.devices}_cpu_twins", twins, default_threads),
    )
    for name, devices, threads in runs:
        torch.set_num_threads(threads)
        seconds, _ = timed(
            lambda d=devices, n=name: gen.generate_images(
                run_dir, prompts, seeds, work / n, devices=d, **options
            )
        )
        rate = result["images"] / seconds
        result[name] = {"seconds": round(seconds, 2), "images_per_s": round(rate, 2)}
    seconds, _ = timed(
        lambda: gen.generate_images(run_dir, prompts, seeds, work / runs[1][0], **options)
    )
    result["rerun_nothing_to_make_s"] = round(seconds, 3)
    print(json.dumps(result))


def full_size(args) -> None:
    """SD1.5 at 512 px on one device: images/s of `generate_images` (module docstring)."""
    from bench.train import write_catalog
    from catalog import load_catalog
    from sdtrain.checkpoint import write_checkpoint
    from sdtrain.config import TrainConfig
    from sdtrain.models import build_unet

    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-generate-"))
    model = write_catalog(work, "full")
    run_dir = work / "run"
    state = build_unet(load_catalog().model(model)).state_dict()
    config = TrainConfig(
        phase="bench", phase_dir=str(work), run_dir=str(run_dir), model=model, lr=1e-4,
        warmup_steps=0, epochs=1, batch_size=1, cfg_dropout=0.1, min_snr_gamma=5.0,
    )  # fmt: skip
    write_checkpoint(run_dir / "final", unet=state, unet_ema=state, config=config)
    del state
    prompts = [f"a photo of object {i}, studio lighting" for i in range(args.images)]
    options = dict(settings=gen.Settings(num_steps=args.steps), batch_size=args.batch_size)
    devices = [args.device]
    warm = prompts[: args.batch_size]
    warm_s, _ = timed(
        lambda: gen.generate_images(run_dir, warm, [0], work / "warm", devices=devices, **options)
    )
    seconds, _ = timed(
        lambda: gen.generate_images(run_dir, prompts, [1], work / "out", devices=devices, **options)
    )
    cuda = torch.device(args.device).type == "cuda"
    print(
        json.dumps(
            {
                "bench": "generate",
                "size": "full",
                "device": args.device,
                "gpu": torch.cuda.get_device_name() if cuda else None,
                "resolution": load_catalog().model(model).resolution,
                "images": len(prompts),
                "steps": args.steps,
                "guidance_scale": gen.DEFAULT_SETTINGS.guidance_scale,
                "batch_size": args.batch_size,
                "warm_up_s": round(warm_s, 2),
                "seconds": round(seconds, 2),
                "images_per_s": round(len(prompts) / seconds, 3),
                "torch": torch.__version__,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            }
        )
    )


if __name__ == "__main__":
    main()
