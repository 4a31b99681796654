"""Training throughput: sdpipe's loop on stored latents vs the diffusers example's naive loop.

The naive loop decodes JPEGs and VAE/text-encodes every step; both run --repeats times,
alternating, best run kept (other load only slows a run). CUDA adds MFU: FLOPs of one step
(flop_counter, no recompute) x steps/s / dense bf16 peak. Prints one JSON object.

Issue 20's data paths (docs/training-data.md):
- `--train-time-captions`: the phase set gets tag captions (one to three per row) and
  `captions.arrow`; after the runs, the loader's data path is timed over the same batches with
  the stored ids and with train-time captions (`sdtrain.captions`: drawn, shuffled, dropped,
  tokenized per batch in the loader's collate, and one call per caption), and the data wait it
  adds is reported as a share of the measured step.
- `--buckets`: the phase set is written as mix writes a bucketed one (a latent file per
  bucket, [n, 1, 4, h, w], `files.json` naming bucket/views/channels, the manifest's
  `bucket`) and the loop reads it with the bucketed sampler (a batch per bucket).
With `--train-time-captions` the sdpipe loop itself tokenizes in the loader (seed 002's tag
augmentation on): its `data_wait_fraction` is the trainer's own measure with them.

Issue 28 (GPU speed): the trainer runs every batch shape once before step 1 on a GPU
(`warm_up`) and compiles the UNet with `--compile` (the config's `compile`). `--baseline` also
runs the loop as it was before (no compile, no warm-up) in the same process on the same phase
set, for `--baseline-steps`, and reports `baseline_samples_per_s` and `speedup_vs_baseline`.
Rates: `samples_per_s` is the steady rate (the logged windows after the first; with more than
`--first-steps` steps, the windows after them), `first_steps_samples_per_s` the rate over the
first `--first-steps` steps (every window, the first included, warm-up excluded: it is
`warm_up_seconds`), and their ratio.
Usage: python bench/train.py [--device cpu|cuda] [--size tiny|full] [--steps N] [--batch-size B]
       [--train-time-captions] [--buckets]
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

DENSE_BF16_PEAK_FLOPS = 989e12  # H100 / H200 SXM, dense
# Seed 002's tag augmentation: the trainer's with --train-time-captions, and the loader timed.
CAPTION_AUGMENTATION = {"shuffle_tags_p": 0.5, "keep_tokens": 1, "tag_dropout": 0.1}


def write_catalog(work: Path, size: str) -> str:
    """This process's catalog: a copy with a `bench` model, the tiny twin or SD1.5 with random
    weights."""
    from bench.catalogs import bench_model, use_copy
    from catalog.copies import edit_entries

    with edit_entries(use_copy(work) / "models.yaml") as models:
        models["bench"] = bench_model(models, full=size == "full")
    return "bench"


def tag_captions(num_rows: int, rng: np.random.Generator) -> list[list[str]]:
    """Seed 002-style captions: a score tag, then 12-30 tags of a 3,000-tag vocabulary; one to
    three captions per row."""
    syllables = ["ka", "lo", "mi", "ra", "te", "su", "no", "vi", "pe", "zu", "ha", "do"]
    vocab = [
        " ".join(
            "".join(rng.choice(syllables, rng.integers(2, 4))) for _ in range(rng.integers(1, 3))
        )
        for _ in range(3000)
    ]
    rows = []
    for _ in range(num_rows):
        options = []
        for _ in range(rng.integers(1, 4)):
            tags = rng.choice(vocab, rng.integers(12, 31), replace=False).tolist()
            options.append(", ".join([f"scr{rng.choice([100, 200, 400, 800])}", *tags]))
        rows.append(options)
    return rows


def write_data(
    work: Path,
    *,
    num_rows: int,
    resolution: int,
    train_time_captions: bool = False,
    plan=None,
    images: bool = True,
) -> tuple[Path, list[bytes], list[str]]:
    """A phase set in the mix stage's layout, and the JPEGs + captions the naive loop reads.

    `plan` (a `catalog.buckets.BucketPlan`): the bucketed layout, rows spread over the plan's
    buckets nearest 1:1, 4:3, 3:4, 16:9 and 9:16."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from tasks.latents.tokenize import tokens_table

    phase = work / "phase"
    (phase / "latents").mkdir(parents=True)
    (phase / "tokens").mkdir()
    rng = np.random.default_rng(0)
    side = resolution // 8
    keys = [f"bench/{i:06d}" for i in range(num_rows)]
    if train_time_captions:
        listed = tag_captions(num_rows, rng)
        captions = [options[0] for options in listed]
    else:
        listed, captions = None, [f"a photo of object {i}" for i in range(num_rows)]
    tokens = tokens_table(keys, captions)
    if listed is not None:
        tokens = tokens.append_column("captions", pa.array(listed, pa.list_(pa.string())))
    pq.write_table(tokens, phase / "tokens" / "bench-00000.parquet")
    if plan is not None:
        write_buckets(phase, plan, num_rows, rng)
    else:
        latents = rng.standard_normal((num_rows, 4, side, side)).astype(np.float16)
        np.save(phase / "latents" / "bench-00000.npy", latents)
        manifest = {
            "dataset": ["bench"] * num_rows,
            "source": ["bench"] * num_rows,
            "shard": ["00000"] * num_rows,
            "latent_row": list(range(num_rows)),
            "token_row": list(range(num_rows)),
            "key": keys,
        }
        pq.write_table(pa.table(manifest), phase / "manifest.parquet")
    if train_time_captions:
        from sdtrain.captions import write_captions

        write_captions(phase, root=work)
    jpegs = []
    for _ in range(num_rows if images else 0):  # the naive loop's inputs
        pixels = rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        jpegs.append(buffer.getvalue())
    return phase, jpegs, captions


def write_buckets(phase: Path, plan, num_rows: int, rng: np.random.Generator) -> None:
    """The bucketed phase set of docs/training-data.md over `tokens/bench-00000.parquet`: a
    latent file per bucket `bench-00000.<WxH>` fp16 [n, 1, 4, h/8, w/8], its tokens linked to
    the shard's, rows by bucket (file, bucket row, token row), the manifest's `bucket`."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from sdtrain import layout

    aspects = np.array([1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16])
    sizes = plan.sizes()
    wanted = np.unique(plan.assign(aspects * 1000, np.full(len(aspects), 1000)))
    bucket_of = wanted[rng.integers(len(wanted), size=num_rows)]
    files, rows, entries = [], [], []
    manifest = {k: [] for k in ("dataset", "source", "shard", "latent_row", "token_row", "key")}
    manifest["bucket"] = []
    for f, b in enumerate(wanted.tolist()):
        w, h = sizes[b].tolist()
        bucket = f"{w}x{h}"
        token_rows = np.flatnonzero(bucket_of == b)
        name = f"bench-00000.{bucket}"
        latents = rng.standard_normal((len(token_rows), 1, 4, h // 8, w // 8)).astype(np.float16)
        np.save(phase / "latents" / f"{name}.npy", latents)
        (phase / "tokens" / f"{name}.parquet").symlink_to("bench-00000.parquet")
        files.append(name)
        rows.append(
            np.stack([np.full(len(token_rows), f), np.arange(len(token_rows)), token_rows], 1)
        )
        entries.append({"bucket": bucket, "views": 1, "channels": 4})
        manifest["dataset"] += ["bench"] * len(token_rows)
        manifest["source"] += ["bench"] * len(token_rows)
        manifest["shard"] += ["00000"] * len(token_rows)
        manifest["latent_row"] += list(range(len(token_rows)))
        manifest["token_row"] += token_rows.tolist()
        manifest["key"] += [f"bench/{i:06d}" for i in token_rows.tolist()]
        manifest["bucket"] += [bucket] * len(token_rows)
    pq.write_table(pa.table(manifest), phase / layout.MANIFEST)
    rows = np.concatenate(rows).astype(np.int32)
    layout.write_index(phase, files, rows)
    meta = json.loads((phase / layout.FILES).read_text())
    for entry, extra in zip(meta["files"], entries, strict=True):
        entry.update(extra)
    (phase / layout.FILES).write_text(json.dumps(meta))


def bench_captions(args, phase: Path, step_s: float) -> dict:
    """The loader's seconds per batch with stored ids and with train-time captions, over an
    epoch's batches of one bucket each in a seeded order, and the share of a step the captions
    add (`step_s`: the measured seconds of a step without data wait; the loader runs on the
    training thread, num_workers 0, so its time adds to each step).

    Train-time captions are timed as the trainer reads them (`PhaseSet` items (row, epoch)
    through `sdtrain.data.collate`, the batch tokenized in one call) and one call per caption.
    """
    from sdtrain.captions import CaptionSettings, TrainTimeCaptions
    from sdtrain.data import PhaseSet, collate

    captions = TrainTimeCaptions(phase, CaptionSettings(**CAPTION_AUGMENTATION), seed=0)
    stored_set, text_set = PhaseSet(phase), PhaseSet(phase, captions=captions)
    rng = np.random.default_rng(0)
    batches = []
    for bucket in range(len(stored_set.bucket_names)):
        rows = rng.permutation(np.flatnonzero(stored_set.bucket_of_row == bucket))
        batches += [rows[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    batches = [b for b in batches if len(b) == args.batch_size]
    collate([text_set[int(batches[0][0]), 0]])  # the tokenizer is built once per process

    def stored(rows, epoch):
        return collate([stored_set[int(r)] for r in rows])

    def batched(rows, epoch):
        return collate([text_set[int(r), epoch] for r in rows])

    def per_item(rows, epoch):
        items = [stored_set[int(r)] for r in rows]
        return [captions.ids(int(r), epoch) for r in rows], collate(items)

    timings = {}
    for name, load in (("stored", stored), ("collate", batched), ("per_item", per_item)):
        best = float("inf")
        for repeat in range(args.repeats):
            started = time.perf_counter()
            for epoch, rows in enumerate(batches):
                load(rows, epoch + repeat)
            best = min(best, (time.perf_counter() - started) / len(batches))
        timings[name] = best
    extra = timings["collate"] - timings["stored"]
    return {
        "caption_settings": CAPTION_AUGMENTATION,
        "data_ms_per_batch_stored_ids": 1e3 * timings["stored"],
        "data_ms_per_batch_train_time_captions": 1e3 * timings["collate"],
        "data_ms_per_batch_train_time_captions_per_item": 1e3 * timings["per_item"],
        "train_time_captions_per_s": args.batch_size / max(extra, 1e-9),
        "train_time_captions_step_share": max(extra, 0.0) / (step_s + max(extra, 0.0)),
    }


def rates(windows: list[dict], *, global_batch: int, log_every: int) -> tuple[float, float]:
    """(samples/s, data-wait fraction) over logged windows (each `log_every` steps)."""
    seconds = wait = 0.0
    for r in windows:
        dt = log_every * global_batch / r["samples_per_s"]
        seconds += dt
        wait += r["data_wait"] * dt
    return len(windows) * log_every * global_batch / seconds, wait / seconds


def bench_sdpipe(
    args, model: str, phase: Path, run_dir: Path, *, steps: int, baseline: bool = False
) -> dict:
    """One run of sdpipe's trainer; `baseline`: as it ran before issue 28 (eager, no warm-up)."""
    from sdtrain.config import TrainConfig
    from sdtrain.monitor import read_log
    from sdtrain.train import train

    on_gpu = args.device == "cuda"
    if baseline:
        speed = {"compile": False, "warm_up": False}
    else:
        speed = {} if args.compile is None else {"compile": args.compile}
    config = TrainConfig(
        phase="bench",
        phase_dir=str(phase),
        run_dir=str(run_dir),
        model=model,
        lr=1e-5,
        warmup_steps=0,
        epochs=1,
        max_steps=steps,
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
        **speed,
        # Issue 20: captions drawn, shuffled, dropped and tokenized in the loader, on the training
        # thread (num_workers 0), so their cost is part of the data wait the trainer measures.
        train_time_captions=args.train_time_captions,
        **(CAPTION_AUGMENTATION if args.train_time_captions else {}),
    )
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
        summary = train(config)
    records = [r for r in read_log(run_dir / "log.jsonl") if "loss" in r]
    windows = dict(global_batch=args.batch_size, log_every=args.warmup)
    first = [r for r in records if r["step"] <= args.first_steps]
    later = [r for r in records if r["step"] > args.first_steps]
    # The steady rate: the windows after the first, and after the first steps when there are
    # more (every shape seen by then).
    samples_per_s, wait = rates((first[-1:] + later if later else records)[1:], **windows)
    first_rate, _ = rates(first, **windows)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # SD1.5's fill the disk
    shutil.rmtree(run_dir / "final", ignore_errors=True)
    return {
        "samples_per_s": samples_per_s,
        "data_wait_fraction": wait,
        "first_steps": min(args.first_steps, steps),
        "first_steps_samples_per_s": first_rate,
        "first_steps_over_steady": first_rate / samples_per_s,
        "compile": summary["warm_up"]["compile"],
        "warm_up_shapes": summary["warm_up"]["shapes"],
        "warm_up_seconds": summary["warm_up"]["seconds"],
    }


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
    parser.add_argument("--first-steps", type=int, default=200, help="steps of the first rate")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the UNet (default: the trainer's, off)",
    )
    parser.add_argument(
        "--baseline", action="store_true", help="also the loop as before issue 28 (eager)"
    )
    parser.add_argument("--baseline-steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the rates")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop; best kept")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 8 tiny, 24 full")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--peak-flops", type=float, default=DENSE_BF16_PEAK_FLOPS)
    parser.add_argument(
        "--train-time-captions",
        action="store_true",
        help="tag captions + captions.arrow; time the loader with train-time tokenization",
    )
    parser.add_argument(
        "--buckets", action="store_true", help="a bucketed phase set (the model's bucket plan)"
    )
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
        plan = None
        if args.buckets:
            from catalog.buckets import BucketPlan

            # The tiny model's UNet halves its latents once: sides of 16 px (2 latent px).
            plan = (
                BucketPlan(area=64 * 64, step=16, min_side=32, max_side=128)
                if args.size == "tiny"
                else BucketPlan()
            )
        phase, images, captions = write_data(
            work,
            num_rows=max(args.steps, args.baseline_steps if args.baseline else 0) * args.batch_size,
            resolution=resolution,
            train_time_captions=args.train_time_captions,
            plan=plan,
            images=not args.skip_naive,
        )
        sdpipe_runs, naive_runs, baseline_runs = [], [], []
        for i in range(args.repeats):
            if args.baseline:
                run = work / f"baseline-{i}"
                steps = args.baseline_steps
                baseline_runs.append(
                    bench_sdpipe(args, model, phase, run, steps=steps, baseline=True)
                )
                print(f"baseline run {i}: {json.dumps(baseline_runs[-1])}", file=sys.stderr)
            try:
                run = bench_sdpipe(args, model, phase, work / f"run-{i}", steps=args.steps)
            except Exception as e:  # the baseline's figures still print, with the error
                print(f"sdpipe run failed: {e!r}", file=sys.stderr)
                run = {"samples_per_s": float("nan"), "error": repr(e)[:500]}
            sdpipe_runs.append(run)
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
            **max(sdpipe_runs, key=lambda r: r["samples_per_s"] if r["samples_per_s"] > 0 else -1),
            "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in sdpipe_runs],
        }
        if args.train_time_captions:
            step_s = args.batch_size / result["samples_per_s"] * (1 - result["data_wait_fraction"])
            result.update(bench_captions(args, phase, step_s))
        if args.buckets:
            result["buckets"] = sorted(
                p.stem.split(".", 1)[1] for p in (phase / "latents").glob("*.npy")
            )
        if baseline_runs:
            best = max(baseline_runs, key=lambda r: r["samples_per_s"])
            result["baseline"] = {"steps": args.baseline_steps, **best}
            result["baseline_samples_per_s"] = best["samples_per_s"]
            result["speedup_vs_baseline"] = result["samples_per_s"] / best["samples_per_s"]
        if naive_runs:
            result["naive_samples_per_s"] = max(naive_runs)
            result["naive_samples_per_s_runs"] = [round(r, 1) for r in naive_runs]
            result["speedup_vs_naive"] = result["samples_per_s"] / result["naive_samples_per_s"]
        if args.device == "cuda":
            flops = step_flops(model, args.batch_size, args.device)
            steps_per_s = result["samples_per_s"] / args.batch_size
            result["flops_per_step"] = flops
            result["mfu"] = flops * steps_per_s / args.peak_flops
            if baseline_runs:
                base_steps_per_s = result["baseline_samples_per_s"] / args.batch_size
                result["baseline_mfu"] = flops * base_steps_per_s / args.peak_flops
            result["gpu"] = torch.cuda.get_device_name()
        result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
        result["machine"] = f"{platform.machine()} {os.cpu_count()} cores"
        result["torch"] = torch.__version__
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
