"""The eval of one category at SD1.5 size, random weights: seconds per part of
`tasks.evaluation.evaluate`.

`--size full`: the SD1.5 UNet (860M), SD's VAE and CLIP-L text encoder shapes, the ViT-L/14
scorer and the FID Inception, all with random weights; one category of the default eval set (20
prompts x 2 seeds, DDIM 100, CFG 7.5, batch 8); a phase set of `--rows` 512 px images, of which
`--val` are held out (FID) and the rest are training images embedded on demand (an unscored
source) for memorisation. `--size small`: the same on the tiny twins (a CPU check of the script).
Prints one JSON object. Usage: python bench/eval.py [--size full] [--device cuda]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import io
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image


def write_catalog(work: Path, size: str, prompts: int, seeds: int, steps: int) -> Path:
    """This process's catalog: a copy with a `bench` model, scorer, eval set and phase."""
    from bench.catalogs import bench_model, use_copy
    from catalog.copies import edit_entries

    catalog = use_copy(work)
    with edit_entries(catalog / "models.yaml") as models:
        models["bench"] = bench_model(models, full=size == "full")
        scorer = "laion-scoring" if size == "full" else "tiny-scoring"
        models["bench-scoring"] = models[scorer] | {"random_weights": True}
    with edit_entries(catalog / "eval.yaml") as evals:
        forest = evals["default"]["categories"][0]
        evals["bench"] = {
            "seeds": list(range(seeds)),
            "num_steps": steps,
            "scorer": "bench-scoring",
            "fid_random_weights": True,
            "categories": [forest | {"prompts": forest["prompts"][:prompts]}],
        }
    with edit_entries(catalog / "phases.yaml") as phases:
        phases["bench"] = phases["demo"] | {"model": "bench", "eval_set": "bench"}
    return catalog


def write_data(root: Path, rows: int, val: int, resolution: int) -> None:
    """A source `bench` outside the catalog (so unscored: embedded on demand), its phase set
    and the phase's final weights (random)."""
    from catalog import load_catalog
    from sdtrain.checkpoint import write_checkpoint
    from sdtrain.config import TrainConfig
    from sdtrain.models import build_unet, tokenize
    from tests.tasks.conftest import write_fetched

    rng = np.random.default_rng(0)
    keys = [f"bench-{i:05d}" for i in range(rows)]
    fetched = []
    for i, key in enumerate(keys):
        pixels = rng.integers(0, 255, (resolution // 8, resolution // 8, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).resize((resolution, resolution)).save(buf, format="JPEG")
        fetched.append({"key": key, "caption": f"a photo {i}", "image": buf.getvalue()})
    write_fetched(root, "bench", fetched)
    phase = root / "phases" / "bench"
    (phase / "latents").mkdir(parents=True)
    (phase / "tokens").mkdir()
    side = resolution // 8
    np.save(phase / "latents" / "bench-00000.npy",
            rng.standard_normal((rows, 4, side, side)).astype(np.float16))  # fmt: skip
    ids = tokenize([r["caption"] for r in fetched]).to(torch.int32)
    pq.write_table(pa.table({"key": keys, "input_ids": [i.tolist() for i in ids]}),
                   phase / "tokens" / "bench-00000.parquet")  # fmt: skip
    pq.write_table(
        pa.table({"source": ["bench"] * rows, "shard": ["00000"] * rows,
                  "latent_row": list(range(rows)), "token_row": list(range(rows)), "key": keys,
                  "dataset": ["bench"] * rows}),
        phase / "manifest.parquet",
    )  # fmt: skip
    unet = build_unet(load_catalog().model("bench")).state_dict()
    config = TrainConfig(
        phase="bench", phase_dir=str(phase), run_dir=str(root / "runs" / "bench"), model="bench",
        lr=1e-5, warmup_steps=0, epochs=1, batch_size=1, cfg_dropout=0.1, min_snr_gamma=5.0,
        num_val_samples=val,
    )  # fmt: skip
    write_checkpoint(root / "runs" / "bench" / "final", unet=unet, unet_ema=unet, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("full", "small"), default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=256, help="phase-set rows (images)")
    parser.add_argument("--val", type=int, default=64, help="rows held out (FID)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-eval-"))
    write_catalog(work, args.size, args.prompts, args.seeds, args.steps)
    from catalog import load_catalog
    from tasks.evaluation.evaluate import evaluate

    resolution = load_catalog().model("bench").resolution
    start = time.perf_counter()
    write_data(work / "data", args.rows, args.val, resolution)
    setup = time.perf_counter() - start
    try:
        summary = evaluate(work / "data", "bench", devices=[args.device], log=lambda s: None)
        again = evaluate(work / "data", "bench", devices=[args.device], log=lambda s: None)
    finally:
        shutil.rmtree(work)
    seconds = summary["seconds"]
    if args.device.startswith("cuda"):
        device = torch.cuda.get_device_name()
    else:
        device = f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    print(json.dumps({
        "what": "eval of one category (forest) with random weights",
        "size": args.size, "resolution": resolution,
        "device": device,
        "torch": torch.__version__,
        "images": summary["num_images"], "ddim_steps": args.steps,
        "training_images_embedded": summary["memorisation"]["num_training_rows"],
        "held_out_images": summary["fid"]["num_validation"],
        "seconds": seconds,
        "images_per_s": round(summary["num_images"] / seconds["generate"], 3),
        "rerun_seconds": again["seconds"],  # nothing left to generate or embed
        "setup_seconds": round(setup, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
