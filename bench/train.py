"""Training throughput: sdpipe's loop on stored latents vs the diffusers example's naive loop.

The naive loop decodes JPEGs and VAE/text-encodes every step; both run --repeats times,
alternating, best run kept (other load only slows a run). CUDA adds MFU: FLOPs of one step
(flop_counter, no recompute) x steps/s / dense bf16 peak. Prints one JSON object.
Usage: python bench/train.py [--device cpu|cuda] [--size tiny|full] [--steps N] [--batch-size B]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import yaml

from bench.encode import SD_VAE

DENSE_BF16_PEAK_FLOPS = 989e12  # H100 / H200 SXM, dense
# SD1.5's VAE and CLIP ViT-L/14 text encoder as configs: the full-size bench builds them with
# random weights (speed does not depend on the values) so it runs without downloads.
SD_VAE_CONFIG = SD_VAE | {"sample_size": 512}  # sd-vae-ft-mse, as bench/encode.py
CLIP_L_TEXT_CONFIG = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 49407,
}


def write_catalog(work: Path, size: str) -> str:
    """A catalog copy with a `bench` model: the tiny twin, or SD1.5 with random weights."""
    from catalog.loader import PACKAGED_DIR

    catalog = work / "catalog"
    shutil.copytree(PACKAGED_DIR, catalog, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    models = yaml.safe_load((catalog / "models.yaml").read_text())
    if size == "tiny":
        bench = dict(models["tiny"])
    else:
        bench = {
            "resolution": 512,
            "unet_config": models["sd15"]["unet_config"],
            "vae_config": SD_VAE_CONFIG,
            "text_config": CLIP_L_TEXT_CONFIG,
        }
    models["bench"] = bench
    (catalog / "models.yaml").write_text(yaml.safe_dump(models))
    os.environ["SDPIPE_CATALOG"] = str(catalog)
    return "bench"


def write_data(
    work: Path, *, num_rows: int, resolution: int
) -> tuple[Path, list[bytes], list[str]]:
    """A phase set in the mix stage's layout, and the JPEGs + captions the naive loop reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from PIL import Image

    from sdtrain.models import tokenize

    phase = work / "phase"
    (phase / "latents").mkdir(parents=True)
    (phase / "tokens").mkdir()
    rng = np.random.default_rng(0)
    side = resolution // 8
    latents = rng.standard_normal((num_rows, 4, side, side)).astype(np.float16)
    np.save(phase / "latents" / "bench-00000.npy", latents)
    captions = [f"a photo of object {i}" for i in range(num_rows)]
    keys = [f"bench/{i:06d}" for i in range(num_rows)]
    ids = tokenize(captions).to(torch.int32)
    pq.write_table(
        pa.table({"key": keys, "input_ids": [r.tolist() for r in ids]}),
        phase / "tokens" / "bench-00000.parquet",
    )
    manifest = {
        "dataset": ["bench"] * num_rows,
        "source": ["bench"] * num_rows,
        "shard": ["00000"] * num_rows,
        "latent_row": list(range(num_rows)),
        "token_row": list(range(num_rows)),
        "key": keys,
    }
    pq.write_table(pa.table(manifest), phase / "manifest.parquet")
    images = []
    for _ in range(num_rows):
        pixels = rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        images.append(buffer.getvalue())
    return phase, images, captions


def steady_rates(records: list[dict], *, global_batch: int, log_every: int) -> tuple[float, float]:
    """(samples/s, data-wait fraction) over the logged windows after the first."""
    seconds = wait = samples = 0.0
    for r in records[1:]:
        dt = log_every * global_batch / r["samples_per_s"]
        seconds += dt
        wait += r["data_wait"] * dt
        samples += log_every * global_batch
    return samples / seconds, wait / seconds


def bench_sdpipe(args, model: str, phase: Path, run_dir: Path) -> dict:
    from sdtrain.config import TrainConfig
    from sdtrain.monitor import read_log
    from sdtrain.train import train

    on_gpu = args.device == "cuda"
    config = TrainConfig(
        phase="bench",
        phase_dir=str(phase),
        run_dir=str(run_dir),
        model=model,
        lr=1e-5,
        warmup_steps=0,
        epochs=1,
        max_steps=args.steps,
        batch_size=args.batch_size,
        cfg_dropout=0.1,
        min_snr_gamma=5.0,
        num_val_samples=0,
        checkpoint_every=0,
        keep_every=0,
        validate_every=0,
        sample_every=0,
        log_every=args.warmup,
        sample_prompts=("a photo",),
        sample_steps=2,
        channels_last=on_gpu,
        gradient_checkpointing=on_gpu and args.gradient_checkpointing,
        latents_in_ram=True,
    )
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
        train(config)
    records = [r for r in read_log(run_dir / "log.jsonl") if "loss" in r]
    samples_per_s, wait = steady_rates(records, global_batch=args.batch_size, log_every=args.warmup)
    return {"samples_per_s": samples_per_s, "data_wait_fraction": wait}


def bench_naive(args, model_name: str, images: list[bytes], captions: list[str]) -> float:
    """Samples/s of the diffusers example's loop: images are decoded and VAE-encoded per step."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from diffusers.training_utils import EMAModel
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset
    from torchvision import transforms

    from catalog import load_catalog
    from sdtrain.models import build_text_encoder, build_tokenizer, build_unet, build_vae
    from sdtrain.objective import NOISE_SCHEDULE

    device = torch.device(args.device)
    model = load_catalog().model(model_name)
    tokenizer = build_tokenizer()
    transform = transforms.Compose(
        [
            transforms.Resize(model.resolution),
            transforms.CenterCrop(model.resolution),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ]
    )

    class Images(Dataset):
        def __len__(self):
            return len(images)

        def __getitem__(self, i):
            pixels = transform(Image.open(io.BytesIO(images[i])).convert("RGB"))
            ids = tokenizer(
                captions[i], padding="max_length", truncation=True, return_tensors="pt"
            ).input_ids[0]
            return pixels, ids

    unet = build_unet(model).to(device).train()
    vae = build_vae(model).to(device).requires_grad_(False)
    text_encoder = build_text_encoder(model).to(device).requires_grad_(False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vae.to(dtype=dtype)
    text_encoder.to(dtype=dtype)
    ema = EMAModel(unet.parameters(), decay=0.9999)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, weight_decay=1e-2)
    scheduler = DDPMScheduler(**NOISE_SCHEDULE)
    loader = DataLoader(Images(), batch_size=args.batch_size, shuffle=True, drop_last=True)
    autocast = torch.autocast(device.type, dtype, enabled=device.type == "cuda")
    started = None
    for step, (pixels, ids) in enumerate(loader):
        if step == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        if step == args.steps:
            break
        pixels, ids = pixels.to(device, dtype), ids.to(device)
        with torch.no_grad():
            latents = vae.encode(pixels).latent_dist.sample() * model.scaling_factor
            text_emb = text_encoder(ids).last_hidden_state
        noise = torch.randn_like(latents, dtype=torch.float32)
        timesteps = torch.randint(0, 1000, (len(latents),), device=device)
        noisy = scheduler.add_noise(latents.float(), noise, timesteps)
        with autocast:
            pred = unet(noisy, timesteps, text_emb).sample
        loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ema.step(unet.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (args.steps - args.warmup) * args.batch_size / (time.perf_counter() - started)


def step_flops(model_name: str, batch_size: int, device: str) -> int:
    """FLOPs of one training step on `batch_size` samples, counted once (no recompute)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from catalog import load_catalog
    from sdtrain.models import build_text_encoder, build_unet, tokenize
    from sdtrain.objective import diffusion_loss, draw_noise

    model = load_catalog().model(model_name)
    device = torch.device(device)
    unet = build_unet(model).to(device).train()
    text_encoder = build_text_encoder(model).to(device).requires_grad_(False)
    side = model.resolution // 8
    latents = torch.randn(batch_size, 4, side, side, device=device)
    noise, timesteps, _ = draw_noise(
        torch.arange(batch_size), seed=0, epoch=0, latent_shape=(4, side, side)
    )
    ids = tokenize(["a photo"] * batch_size).to(device)
    with FlopCounterMode(display=False) as counter, torch.autocast(device.type, torch.bfloat16):
        with torch.no_grad():
            text_emb = text_encoder(ids).last_hidden_state
        loss = diffusion_loss(
            unet,
            latents,
            text_emb,
            noise.to(device),
            timesteps.to(device),
            gamma=5.0,
            prediction_type="epsilon",
        )
        loss.backward()
    return counter.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the rates")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop; best kept")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 8 tiny, 24 full")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--peak-flops", type=float, default=DENSE_BF16_PEAK_FLOPS)
    args = parser.parse_args()
    args.batch_size = args.batch_size or (8 if args.size == "tiny" else 24)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks CUDA whenever it sees one

    import torch

    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-train-"))
    try:
        model = write_catalog(work, args.size)
        resolution = 64 if args.size == "tiny" else 512
        phase, images, captions = write_data(
            work, num_rows=args.steps * args.batch_size, resolution=resolution
        )
        sdpipe_runs, naive_runs = [], []
        for i in range(args.repeats):
            sdpipe_runs.append(bench_sdpipe(args, model, phase, work / f"run-{i}"))
            if not args.skip_naive:
                naive_runs.append(bench_naive(args, model, images, captions))
        result = {
            "bench": "train",
            "device": args.device,
            "size": args.size,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "repeats": args.repeats,
            **max(sdpipe_runs, key=lambda r: r["samples_per_s"]),
            "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in sdpipe_runs],
        }
        if naive_runs:
            result["naive_samples_per_s"] = max(naive_runs)
            result["naive_samples_per_s_runs"] = [round(r, 1) for r in naive_runs]
            result["speedup_vs_naive"] = result["samples_per_s"] / result["naive_samples_per_s"]
        if args.device == "cuda":
            flops = step_flops(model, args.batch_size, args.device)
            steps_per_s = result["samples_per_s"] / args.batch_size
            result["flops_per_step"] = flops
            result["mfu"] = flops * steps_per_s / args.peak_flops
            result["gpu"] = torch.cuda.get_device_name()
        result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
        result["machine"] = f"{platform.machine()} {os.cpu_count()} cores"
        result["torch"] = torch.__version__
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
