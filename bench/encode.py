"""Encode throughput, measured in one run on the same images; prints JSON.

`vae_only_ips`: the VAE alone on decoded pixels already in (device) memory, the ceiling.
`pipeline_ips`: `encode_shards` from tar shards. `naive_ips`: PIL decode and resize, one image at
a time, no overlap. On CPU the decoders take their cores from the VAE, so `--size small` uses a
VAE config whose encode costs >= 10x the decode (the JSON reports both); `--size full` is the SD
VAE encoder (random weights, same FLOPs) at 512 px, bf16 on a GPU.
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

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from catalog import Model
from tasks import encode, images
from tasks.shards import read_stats

SOURCE = "bench"
SD_VAE = {  # stabilityai/sd-vae-ft-mse
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
}
# The CPU config: SD's layout (4 blocks, /8) at 1/8 to 1/16 of its widths, one layer per block:
# an encode ~14x the cost of a 1024 px JPEG decode on the development VM.
SMALL_VAE = SD_VAE | {
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 16,
}
SIZES = {"small": (256, SMALL_VAE), "full": (512, SD_VAE)}


def photo_like(rng: np.random.Generator, side: int) -> np.ndarray:
    """Noise at every scale (amplitude ~ scale): a JPEG about as costly to decode as a photo."""
    out = np.zeros((side, side, 3), np.float32)
    for cell in (256, 64, 16, 4, 1):
        n = side // cell
        noise = rng.normal(size=(n, n, 3)).astype(np.float32)
        out += cell**0.5 * cv2.resize(noise, (side, side), interpolation=cv2.INTER_CUBIC)
    out = (out - out.min()) / (out.max() - out.min()) * 255
    return out.astype(np.uint8)


def write_shards(
    root: Path, num_images: int, shard_size: int, side: int, num_unique: int
) -> list[bytes]:
    """`num_images` JPEGs (q90) in tar shards + token tables; returns the images in order."""
    rng = np.random.default_rng(0)
    unique = []
    for _ in range(min(num_images, num_unique)):
        buf = io.BytesIO()
        Image.fromarray(photo_like(rng, side)).save(buf, format="JPEG", quality=90)
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


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vae_only(model: Model, pixels: torch.Tensor, batch_size: int, compile: bool):
    """(images/s, CPU seconds per image) of the encoder alone, as the pipeline runs it, on
    pixels already in device memory."""
    sync(pixels.device)
    wall, cpu = time.perf_counter(), time.process_time()
    encode.encode_pixels(model, pixels, batch_size=batch_size, compile=compile)
    sync(pixels.device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return len(pixels) / wall, cpu / len(pixels)


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
    parser.add_argument("--repeats", type=int, default=5, help="best of, each measurement")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    size = args.size or ("full" if cuda else "small")
    resolution, vae_config = SIZES[size]
    if args.channels:
        channels = [int(c) for c in args.channels.split(",")]
        groups = min(32, math.gcd(*channels))
        vae_config = vae_config | {"block_out_channels": channels, "norm_num_groups": groups}
    num_images = args.num_images or (2048 if cuda else 128)
    batch_size = args.batch_size or (32 if cuda else 4)
    shard_size = args.shard_size or (256 if cuda else 64)
    workers = args.workers or encode.default_num_workers(device)
    model = Model(
        name=f"bench-{size}",
        resolution=resolution,
        vae_config=vae_config | {"sample_size": resolution},
    )

    with tempfile.TemporaryDirectory(prefix="sdpipe-bench-") as tmp:
        tmp = Path(tmp)
        datas = write_shards(tmp / "inputs", num_images, shard_size, args.input_side, 64)
        shards = sorted(p.stem for p in (tmp / "inputs" / SOURCE / "tokens").glob("*.parquet"))
        options = dict(
            batch_size=batch_size, device=device, num_workers=workers, compile=args.compile
        )

        # Warm up (VAE build, decode workers, cuDNN autotune, compile) on the first shard.
        encode.encode_shards(
            linked_root(tmp / "inputs", tmp / "warm"), SOURCE, shards[:1], model, **options
        )
        cpu = time.process_time()
        decoded = [images.decode_image(d, resolution) for d in datas[:64]]
        decode_cpu_s = (time.process_time() - cpu) / len(decoded)
        pixels = torch.from_numpy(
            np.stack([decoded[i % len(decoded)] for i in range(num_images)])
        ).to(device)
        vae = encode.vae_for(model, device)
        num_naive = args.naive_images or (512 if cuda else num_images)

        gflop = gflop_per_image(model, pixels)
        best = {"vae_only": 0.0, "pipeline": 0.0, "naive": 0.0}
        encode_cpu_s, waited = float("inf"), None
        for r in range(args.repeats):
            ips, cpu_s = vae_only(model, pixels, batch_size, args.compile)
            best["vae_only"] = max(best["vae_only"], ips)
            encode_cpu_s = min(encode_cpu_s, cpu_s)
            root = linked_root(tmp / "inputs", tmp / f"run{r}")
            start = time.perf_counter()
            encode.encode_shards(root, SOURCE, shards, model, **options)
            best["pipeline"] = max(best["pipeline"], num_images / (time.perf_counter() - start))
            waited = sum(s.extra["data_wait_seconds"] for s in read_stats(root, SOURCE, "latents"))
            best["naive"] = max(best["naive"], naive(vae, datas[:num_naive], model, device))

        latents = encode.encode_pixels(
            model, pixels[:batch_size], batch_size=batch_size, compile=args.compile
        )
        reference = latents.float().cpu().numpy()
        first = np.load(root / SOURCE / "latents" / f"{shards[0]}.npy")[:batch_size]

    result = {
        "device": torch.cuda.get_device_name(device) if cuda else cpu_name(),
        "size": size,
        "vae_config": model.vae_config,
        "precision": "bf16 autocast" if cuda else "fp32",
        "compile": args.compile,
        "input": f"{args.input_side}px JPEG q90 (64 distinct images, cycled)",
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
        "pipeline_ips": round(best["pipeline"], 2),
        "efficiency": round(best["pipeline"] / best["vae_only"], 3),
        "naive_ips": round(best["naive"], 2),
        "speedup_vs_naive": round(best["pipeline"] / best["naive"], 2),
        "pipeline_waited_for_data_s": round(waited, 3),
        "pipeline_max_abs_diff_vs_vae_only": float(np.abs(first - reference).max()),
        "repeats": args.repeats,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
