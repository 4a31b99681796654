"""Encode throughput, measured in one run on the same images; prints JSON.

`vae_only_ips`: the VAE alone on decoded pixels already in (device) memory, the ceiling.
`pipeline_ips`: `encode_shards` from tar shards. `naive_ips`: PIL decode and resize, one image at
a time, no overlap. On CPU the decoders take their cores from the VAE, so `--size small` uses a
VAE config whose encode costs >= 10x the decode (the JSON reports both); `--size full` is the SD
VAE encoder (random weights, same FLOPs) at 512 px, bf16 on a GPU.

`--layouts legacy,buckets,flips,flips+sampling` also times `encode_shards` under other latent
layouts (docs/training-data.md, "Latents on disk"), in the same run on the same shards: per
layout, images/s (best of --repeats, a fresh data root each, each layout warmed up on the first
shard as legacy is), its ratio to legacy, the bytes of latents written per image and the rows
per bucket. `legacy`: the model's square, no flips, the mean (always measured: the baseline);
`buckets`: the model with a bucket plan; `flips`: and the mirrored view (V = 2); `sampling`:
and the log-variance (C = 8). Every layout but legacy is bucketed: tokens join with `+`. The
plans are kohya's / SimpleTuner's at 512 px (area 512^2, step 64, sides 256..1024, aspect
1:2..2:1) and, for `--size small` (256 px), the same plan at half scale (area 256^2, step 32,
sides 128..512): the same five aspects, and latent sides multiples of 4 (even) under the /8 VAE.

`--held-bytes` also runs the legacy layout once more, untimed, under tracemalloc: the peak of
what the pipeline holds in Python objects and numpy arrays (image bytes, decoded pixels,
latents; not torch's ring or the VAE's activations) over all shards, in MiB, beside the
largest shard's tar (`held_peak_mib`, `shard_mib`): bounded by the batches in flight, not the
shard (issue 26.6).

`--baseline autocast` (the default on a GPU) also times the legacy layout under sdpipe's GPU
numerics before issue 28 (fp32 weights under bf16 autocast) in the same run, interleaved with
the others: `baseline_ips` and `speedup_vs_baseline`. `numerics` compares each precision's
latents with the fp32 VAE's (TF32 off) on the same pixels: max and RMS absolute difference, and
the max over the reference's standard deviation.

With any layout but legacy the inputs are a LAION-like mix of aspect ratios (`--aspects mixed`,
for every layout of the run; legacy center-crops them), of `--input-side`^2 pixels each
(width x height rounded to 8): of every 20 images, 9 near-square (1:1 x5, 1.1:1 x2, 1:1.1 x2),
5 landscape 4:3 (x3) or 3:2 (x2), 3 at 16:9, 3 portrait 2:3 (x1) or 3:4 (x2), i.e. 45 / 25 /
15 / 15 %; 60 distinct images, cycled. Legacy alone keeps the square inputs of earlier runs.
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
import math
import os
import platform
import tarfile
import tempfile
import time
import tracemalloc
from dataclasses import replace

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from catalog import Model
from catalog.architectures import SD_VAE_CONFIG
from tasks.latents import encode, images
from tasks.runtime.shards import read_stats

SOURCE = "bench"
# The CPU config: SD's layout (4 blocks, /8) at 1/8 to 1/16 of its widths, one layer per block:
# an encode ~14x the cost of a 1024 px JPEG decode on the development VM.
SMALL_VAE = SD_VAE_CONFIG | {
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 16,
}
SIZES = {"small": (256, SMALL_VAE), "full": (512, SD_VAE_CONFIG)}
# The bucket plan of each size: kohya's at 512 px; at 256 px the same plan at half scale (the
# same five buckets' aspects; step 32 keeps the latent sides multiples of 4 under the /8 VAE).
PLANS = {
    "small": {"area": 256 * 256, "step": 32, "min_side": 128, "max_side": 512, "max_aspect": 2.0},
    "full": {"area": 512 * 512, "step": 64, "min_side": 256, "max_side": 1024, "max_aspect": 2.0},
}
LAYOUT_TOKENS = ("buckets", "flips", "sampling")


# (width / height, how many of every 20 images): a LAION-like mix, see the module docstring.
ASPECT_MIX = (
    (1.0, 5), (1.1, 2), (1 / 1.1, 2),  # near-square, 45 %
    (4 / 3, 3), (3 / 2, 2),  # landscape 4:3 / 3:2, 25 %
    (16 / 9, 3),  # 15 %
    (2 / 3, 1), (3 / 4, 2),  # portrait, 15 %
)  # fmt: skip


def photo_like(rng: np.random.Generator, width: int, height: int | None = None) -> np.ndarray:
    """Noise at every scale (amplitude ~ scale): a JPEG about as costly to decode as a photo.
    [height, width, 3] uint8; `height` defaults to `width` (a square: the same pixels as
    before, for the same rng)."""
    height = height or width
    out = np.zeros((height, width, 3), np.float32)
    for cell in (256, 64, 16, 4, 1):
        nw, nh = max(1, width // cell), max(1, height // cell)
        noise = rng.normal(size=(nh, nw, 3)).astype(np.float32)
        out += cell**0.5 * cv2.resize(noise, (width, height), interpolation=cv2.INTER_CUBIC)
    out = (out - out.min()) / (out.max() - out.min()) * 255
    return out.astype(np.uint8)


def mixed_sizes(side: int, count: int) -> list[tuple[int, int]]:
    """(width, height) of `count` images in `ASPECT_MIX`'s proportions, ~`side`^2 pixels each."""
    aspects = [a for a, n in ASPECT_MIX for _ in range(n)]
    sizes = []
    for i in range(count):
        a = aspects[i % len(aspects)]
        sizes.append((round(side * a**0.5 / 8) * 8, round(side / a**0.5 / 8) * 8))
    return sizes


def write_shards(
    root: Path,
    num_images: int,
    shard_size: int,
    side: int,
    num_unique: int,
    mixed: bool = False,
) -> list[bytes]:
    """`num_images` JPEGs (q90) in tar shards + token tables; returns the images in order.
    `mixed`: of `mixed_sizes`, else `side` squares."""
    rng = np.random.default_rng(0)
    count = min(num_images, num_unique)
    sizes = mixed_sizes(side, count) if mixed else [(side, side)] * count
    unique = []
    for width, height in sizes:
        buf = io.BytesIO()
        Image.fromarray(photo_like(rng, width, height)).save(buf, format="JPEG", quality=90)
        unique.append(buf.getvalue())
    datas = [unique[i % len(unique)] for i in range(num_images)]
    for stage in ("shards", "tokens"):
        (root / SOURCE / stage).mkdir(parents=True)
    for first in range(0, num_images, shard_size):
        shard = f"{first // shard_size:05d}"
        keys = [f"{i:09d}" for i in range(first, min(first + shard_size, num_images))]
        with tarfile.open(root / SOURCE / "shards" / f"{shard}.tar", "w") as tar:
            for key in keys:
                for name, payload in ((f"{key}.jpg", datas[int(key)]), (f"{key}.txt", b"x")):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        ids = pa.array([[0] * 77] * len(keys), pa.list_(pa.int32(), 77))
        pq.write_table(
            pa.table({"key": keys, "input_ids": ids}), root / SOURCE / "tokens" / f"{shard}.parquet"
        )
    return datas


def linked_root(inputs: Path, dest: Path) -> Path:
    """A fresh data root whose shards and tokens are those of `inputs`."""
    (dest / SOURCE).mkdir(parents=True)
    for stage in ("shards", "tokens"):
        (dest / SOURCE / stage).symlink_to(inputs / SOURCE / stage)
    return dest


def parse_layouts(text: str) -> list[str]:
    """`legacy,buckets,flips+sampling` -> the layout names, legacy first (the baseline)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        bad = [t for t in name.split("+") if t not in LAYOUT_TOKENS] if name != "legacy" else []
        if bad:
            raise SystemExit(f"--layouts {name}: unknown {bad} (legacy, or + of {LAYOUT_TOKENS})")
    return ["legacy"] + [n for n in dict.fromkeys(names) if n != "legacy"]


def layout_of(name: str, model: Model, size: str) -> tuple[Model, encode.LatentSpec]:
    """The model and latent spec a layout encodes under: legacy is `model` as given; any other
    layout is bucketed (`PLANS[size]`), with the mirrored view and/or the log-variance."""
    if name == "legacy":
        return model, encode.LatentSpec.of(model)
    tokens = set(name.split("+"))
    bucketed = replace(model, name=f"{model.name}-buckets", buckets=PLANS[size])
    spec = encode.LatentSpec.of(bucketed, flips="flips" in tokens, sampling="sampling" in tokens)
    return bucketed, spec


def written(root: Path, resolution: int) -> tuple[int, dict[str, int]]:
    """(bytes of latents .npy files, rows per bucket) of a data root's encoded shards."""
    latents = root / SOURCE / "latents"
    nbytes = sum(p.stat().st_size for p in latents.glob("*.npy"))
    rows: dict[str, int] = {}
    for stats in read_stats(root, SOURCE, "latents"):
        buckets = stats.extra.get("buckets") or {f"{resolution}x{resolution}": stats.num_out}
        for bucket, n in buckets.items():
            rows[bucket] = rows.get(bucket, 0) + n
    return nbytes, dict(sorted(rows.items()))


def say(line: str) -> None:
    """Progress on stderr, so a run stopped early still tells how far it got (stdout: the JSON)."""
    print(line, file=sys.stderr, flush=True)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vae_only(model: Model, pixels: torch.Tensor, batch_size: int, compile: bool):
    """(images/s, CPU seconds per image) of the encoder alone, as the pipeline runs it (its
    default precision), on pixels already in device memory."""
    sync(pixels.device)
    wall, cpu = time.perf_counter(), time.process_time()
    encode.encode_pixels(model, pixels, batch_size=batch_size, compile=compile)
    sync(pixels.device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return len(pixels) / wall, cpu / len(pixels)


@torch.inference_mode()
def vae_variants(model: Model, pixels: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Images/s of the encoder alone under other numerics and layouts than the stage's (GPU):
    what each lever of issue 28 is worth, on the same pixels, each warmed up first."""
    from sdtrain.models import build_vae

    out = {}
    variants = (
        ("autocast+channels_last", torch.float32, "autocast", True, batch_size),
        ("bf16+channels_last", torch.bfloat16, "bf16", True, batch_size),
        ("bf16+contiguous", torch.bfloat16, "bf16", False, batch_size),
        ("bf16+channels_last+batch_x2", torch.bfloat16, "bf16", True, 2 * batch_size),
    )
    for name, dtype, precision, channels_last, batch in variants:
        vae = build_vae(model).eval().requires_grad_(False)
        if channels_last:
            vae = vae.to(memory_format=torch.channels_last)
        vae = vae.to(device=pixels.device, dtype=dtype)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        autocast = precision == "autocast"

        def fn(b, vae=vae, fmt=fmt, autocast=autocast, dtype=dtype):
            x = encode._vae_input(b, dtype).contiguous(memory_format=fmt)
            with torch.autocast(pixels.device.type, torch.bfloat16, enabled=autocast):
                return vae.encode(x).latent_dist.mean

        for b in pixels[: 2 * batch].split(batch):  # cuDNN's autotuning, outside the timing
            fn(b)
        sync(pixels.device)
        start = time.perf_counter()
        for b in pixels.split(batch):
            fn(b)
        sync(pixels.device)
        out[name] = round(len(pixels) / (time.perf_counter() - start), 2)
        del vae
    return out


@torch.inference_mode()
def numerics(model: Model, pixels: torch.Tensor, batch_size: int, precisions: list[str]) -> dict:
    """Each precision's latents against the fp32 VAE's (TF32 off) on the same pixels."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = encode.encode_pixels(model, pixels, batch_size=batch_size, precision="fp32").float()
    spread = ref.std().item()
    out = {"reference": "fp32 weights, TF32 off", "reference_std": round(spread, 4)}
    for precision in precisions:
        z = encode.encode_pixels(model, pixels, batch_size=batch_size, precision=precision)
        diff = (z.float() - ref).abs()
        out[precision] = {
            "max_abs": round(diff.max().item(), 4),
            "rms": round(diff.pow(2).mean().sqrt().item(), 5),
            "max_abs_over_std": round(diff.max().item() / spread, 4),
        }
    return out


@torch.inference_mode()
def gflop_per_image(model: Model, pixels: torch.Tensor) -> float:
    """The encoder's GFLOP (multiply-add = 2) for one image, counted by torch."""
    encode_fn = encode.encoder_for(model, pixels.device)
    with FlopCounterMode(display=False) as counter:
        encode_fn(pixels[:1])
    return counter.get_total_flops() / 1e9


def naive_pixels(data: bytes, size: int) -> np.ndarray:
    """What a first encoder does: PIL decode, PIL bicubic resize of the short side, crop."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    scale = size / min(img.size)
    w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
    img = img.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - size) // 2, (h - size) // 2
    return np.array(img.crop((left, top, left + size, top + size)))


@torch.inference_mode()
def naive(vae, datas: list[bytes], model: Model, device) -> float:
    encode_fn = encode.latent_encoder(vae, model.scaling_factor)
    encode_fn(torch.from_numpy(naive_pixels(datas[0], model.resolution))[None].to(device))
    sync(device)  # cuDNN picks its batch-1 algorithms outside the timing
    start = time.perf_counter()
    for data in datas:
        x = torch.from_numpy(naive_pixels(data, model.resolution))[None].to(device)
        encode_fn(x).cpu()
    return len(datas) / (time.perf_counter() - start)


def held_bytes(tmp: Path, shards: list[str], model: Model, options: dict) -> dict[str, float]:
    """Peak MiB the legacy pipeline holds in Python objects and numpy arrays over all shards
    (tracemalloc; warmed up already), and the largest shard's tar in MiB."""
    out = linked_root(tmp / "inputs", tmp / "held")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        encode.encode_shards(out, SOURCE, shards, model, **options)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    tars = (tmp / "inputs" / SOURCE / "shards").glob("*.tar")
    shard = max(p.stat().st_size for p in tars)
    say(f"held: peak {peak / 2**20:.1f} MiB, largest shard {shard / 2**20:.1f} MiB")
    return {"held_peak_mib": round(peak / 2**20, 1), "shard_mib": round(shard / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=SIZES, default=None, help="default: small on CPU")
    parser.add_argument("--num-images", type=int, default=None)
    parser.add_argument("--naive-images", type=int, default=None, help="default: all on CPU")
    parser.add_argument("--shard-size", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None, help="decode processes")
    parser.add_argument("--input-side", type=int, default=1024)
    parser.add_argument("--channels", help="the VAE's block_out_channels, e.g. 16,32,64,64")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--precision",
        choices=encode.PRECISIONS,
        default=None,
        help="the encoder's numerics (default: encode.encode_precision's, bf16 on a GPU)",
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="GPU: also the VAE alone under other numerics and layouts (4 more autotunings)",
    )
    parser.add_argument(
        "--baseline",
        choices=(*encode.PRECISIONS, "none"),
        default=None,
        help="the legacy layout also under this precision, side by side (default: autocast on "
        "a GPU, none on CPU)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="best of, each measurement")
    parser.add_argument(
        "--held-bytes",
        action="store_true",
        help="also the peak bytes the pipeline holds (tracemalloc, one more untimed run)",
    )
    parser.add_argument(
        "--layouts",
        default="legacy",
        help="latent layouts timed side by side, e.g. legacy,buckets,flips,flips+sampling",
    )
    parser.add_argument(
        "--aspects",
        choices=("square", "mixed"),
        default=None,
        help="input shapes; default: square for legacy alone, else the LAION-like mix",
    )
    args = parser.parse_args()
    layouts = parse_layouts(args.layouts)
    mixed = (args.aspects or ("square" if layouts == ["legacy"] else "mixed")) == "mixed"

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    size = args.size or ("full" if cuda else "small")
    resolution, vae_config = SIZES[size]
    if args.channels:
        channels = [int(c) for c in args.channels.split(",")]
        groups = min(32, math.gcd(*channels))
        vae_config = vae_config | {"block_out_channels": channels, "norm_num_groups": groups}
    num_images = args.num_images or (2048 if cuda else 128)
    num_unique = 60 if mixed else 64  # the mix's 20-image cycle, 3 times
    batch_size = args.batch_size or (32 if cuda else 4)
    shard_size = args.shard_size or (256 if cuda else 64)
    workers = args.workers or encode.default_num_workers(device)
    precision = encode.encode_precision(device, args.precision)
    baseline = args.baseline or ("autocast" if cuda else "none")
    baseline = None if baseline in ("none", precision) else baseline
    model = Model(
        name=f"bench-{size}",
        resolution=resolution,
        vae_config=vae_config | {"sample_size": resolution},
    )

    with tempfile.TemporaryDirectory(prefix="sdpipe-bench-") as tmp:
        tmp = Path(tmp)
        datas = write_shards(
            tmp / "inputs", num_images, shard_size, args.input_side, num_unique, mixed
        )
        shards = sorted(p.stem for p in (tmp / "inputs" / SOURCE / "tokens").glob("*.parquet"))
        options = dict(
            batch_size=batch_size,
            device=device,
            num_workers=workers,
            compile=args.compile,
            precision=precision,
        )

        # Warm up (VAE build, decode workers, cuDNN autotune, compile) on the first shard, each
        # layout (its own shapes) alike.
        specs = {name: layout_of(name, model, size) for name in layouts}
        runs = dict(specs)  # what is timed: each layout, and the legacy one at the baseline's
        if baseline:
            runs["baseline"] = specs["legacy"]
        for name, (layout_model, spec) in runs.items():
            warm = linked_root(tmp / "inputs", tmp / f"warm-{name}")
            kw = options | ({"precision": baseline} if name == "baseline" else {})
            started = time.perf_counter()
            encode.encode_shards(warm, SOURCE, shards[:1], layout_model, spec=spec, **kw)
            say(f"warm-up {name}: {time.perf_counter() - started:.1f} s")
        cpu = time.process_time()
        decoded = [images.decode_image(d, resolution) for d in datas[:64]]
        decode_cpu_s = (time.process_time() - cpu) / len(decoded)
        pixels = torch.from_numpy(
            np.stack([decoded[i % len(decoded)] for i in range(num_images)])
        ).to(device)
        vae = encode.vae_for(model, device)
        num_naive = args.naive_images or (512 if cuda else num_images)

        gflop = gflop_per_image(model, pixels)
        best = {"vae_only": 0.0, "naive": 0.0} | {name: 0.0 for name in runs}
        outputs = {}
        encode_cpu_s, waited = float("inf"), None
        for r in range(args.repeats):
            ips, cpu_s = vae_only(model, pixels, batch_size, args.compile)
            best["vae_only"] = max(best["vae_only"], ips)
            say(f"repeat {r}: VAE alone {ips:.1f} images/s")
            encode_cpu_s = min(encode_cpu_s, cpu_s)
            for name, (layout_model, spec) in runs.items():  # interleaved: load drifts alike
                out = linked_root(tmp / "inputs", tmp / f"run{r}-{name}")
                kw = options | ({"precision": baseline} if name == "baseline" else {})
                start = time.perf_counter()
                encode.encode_shards(out, SOURCE, shards, layout_model, spec=spec, **kw)
                rate = num_images / (time.perf_counter() - start)
                best[name] = max(best[name], rate)
                say(f"repeat {r}: {name} {rate:.1f} images/s")
                outputs[name] = written(out, resolution)
                if name == "legacy":
                    root = out
            waited = sum(s.extra["data_wait_seconds"] for s in read_stats(root, SOURCE, "latents"))
            best["naive"] = max(best["naive"], naive(vae, datas[:num_naive], model, device))

        latents = encode.encode_pixels(
            model, pixels[:batch_size], batch_size=batch_size, compile=args.compile
        )
        reference = latents.float().cpu().numpy()
        checked = numerics(
            model, pixels[:batch_size], batch_size, [p for p in (precision, baseline) if p]
        )
        variants = vae_variants(model, pixels[:512], batch_size) if cuda and args.variants else None
        if variants:
            say(f"VAE alone, other numerics: {variants}")
        first = np.load(root / SOURCE / "latents" / f"{shards[0]}.npy")[:batch_size]
        held = held_bytes(tmp, shards, model, options) if args.held_bytes else None

    result = {
        "device": torch.cuda.get_device_name(device) if cuda else cpu_name(),
        "size": size,
        "vae_config": model.vae_config,
        "precision": precision,
        "compile": args.compile,
        "input": f"{args.input_side}px JPEG q90 ({num_unique} distinct images, cycled)"
        + (", LAION-like aspect mix (~input_side^2 px)" if mixed else ""),
        "output_side": resolution,
        "num_images": num_images,
        "naive_images": num_naive,
        "shard_size": shard_size,
        "batch_size": batch_size,
        "decode_workers": workers,
        "torch_threads": torch.get_num_threads(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "encode_gflop_per_image": round(gflop, 1),
        "decode_cpu_ms_per_image": round(1e3 * decode_cpu_s, 2),
        # On a GPU the encode's cost is not CPU time: these two are for CPU runs.
        "encode_cpu_ms_per_image": None if cuda else round(1e3 * encode_cpu_s, 2),
        "encode_to_decode_cost": None if cuda else round(encode_cpu_s / decode_cpu_s, 1),
        "vae_only_ips": round(best["vae_only"], 2),
        "pipeline_ips": round(best["legacy"], 2),
        "efficiency": round(best["legacy"] / best["vae_only"], 3),
        "naive_ips": round(best["naive"], 2),
        "speedup_vs_naive": round(best["legacy"] / best["naive"], 2),
        "pipeline_waited_for_data_s": round(waited, 3),
        "pipeline_max_abs_diff_vs_vae_only": float(np.abs(first - reference).max()),
        "repeats": args.repeats,
        "numerics": checked,
        "vae_only_variants_ips": variants,
        "torch": torch.__version__,
    }
    if held:
        result |= held
    if baseline:
        result["baseline_precision"] = baseline
        result["baseline_ips"] = round(best["baseline"], 2)
        result["speedup_vs_baseline"] = round(best["legacy"] / best["baseline"], 3)
    if layouts != ["legacy"] or mixed:  # legacy alone: the output of earlier runs, as it was
        aspects = [round(w / h, 2) for w, h in mixed_sizes(args.input_side, num_unique)]
        counts = {}
        for i in range(num_images):
            key = str(aspects[i % num_unique]) if mixed else "1.0"
            counts[key] = counts.get(key, 0) + 1
        result["input_aspects"] = dict(sorted(counts.items(), key=lambda kv: float(kv[0])))
        result["bucket_plan"] = PLANS[size]
        result["layouts"] = {
            name: {
                "ips": round(best[name], 2),
                "ratio_to_legacy": round(best[name] / best["legacy"], 3),
                "views": spec.views,
                "channels": spec.channels,
                "latent_bytes_per_image": round(outputs[name][0] / num_images),
                "bucket_rows": outputs[name][1],
            }
            for name, (_, spec) in specs.items()
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
