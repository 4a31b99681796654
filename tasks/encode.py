"""encode: a shard's images -> VAE posterior mean x scaling factor -> fp16 `latents/NNNNN.npy`.

Latent row i belongs to the i-th key in the stats record's `keys`, and `token_rows[i]` is that
key's row in `tokens/NNNNN.parquet` (an image that fails to decode is dropped, so the two
tables can differ). Images are brought to the model's resolution by resizing the short side
and center-cropping: the transform the filters and the trainer assume.
"""

from __future__ import annotations

import tarfile
import threading
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import torch

from catalog import Model
from sdtrain.models import build_vae
from tasks.shards import ShardStats, atomic_path, run_shard

STAGE = "latents"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")

_vaes: dict[str, torch.nn.Module] = {}
_vaes_lock = threading.Lock()


def _vae(model: Model, device: torch.device) -> torch.nn.Module:
    """One frozen VAE per model and process, shared by the shard tasks running in threads."""
    with _vaes_lock:
        if model.name not in _vaes:
            _vaes[model.name] = build_vae(model).to(device).eval().requires_grad_(False)
        return _vaes[model.name]


def load_image(data: bytes, size: int) -> np.ndarray | None:
    """RGB uint8 [size, size, 3]: short side resized, center crop; None if undecodable."""
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        return None
    h, w = bgr.shape[:2]
    scale = size / min(h, w)
    if scale != 1:
        interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC
        bgr = cv2.resize(
            bgr, (max(size, round(w * scale)), max(size, round(h * scale))), interpolation=interp
        )
    h, w = bgr.shape[:2]
    top, left = (h - size) // 2, (w - size) // 2
    return cv2.cvtColor(bgr[top : top + size, left : left + size], cv2.COLOR_BGR2RGB)


def read_images(tar_path: Path, keys: set[str]) -> dict[str, bytes]:
    """The image bytes of `keys` from a webdataset tar."""
    out = {}
    with tarfile.open(tar_path) as tar:
        for member in tar:
            key, _, ext = member.name.partition(".")
            if key in keys and ext.lower() in IMAGE_EXTENSIONS and member.isfile():
                out[key] = tar.extractfile(member).read()
    return out


@torch.no_grad()
def encode_images(vae: torch.nn.Module, images: np.ndarray, scaling_factor: float) -> np.ndarray:
    """[N, H, W, 3] uint8 -> fp16 latents [N, 4, H/8, W/8] (posterior mean x scaling factor)."""
    device = next(vae.parameters()).device
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
        mean = vae.encode(x).latent_dist.mean
    return (mean.float() * scaling_factor).to(torch.float16).cpu().numpy()


def encode_shard(
    root: Path, source: str, shard: str, model: Model, *, batch_size: int = 32
) -> ShardStats:
    tokens_path = root / source / "tokens" / f"{shard}.parquet"
    tar_path = root / source / "shards" / f"{shard}.tar"

    def work(stats: ShardStats) -> None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        vae = _vae(model, device)
        token_keys = pq.read_table(tokens_path, columns=["key"])["key"].to_pylist()
        stats.num_in = len(token_keys)
        data = read_images(tar_path, set(token_keys))
        keys, token_rows, pixels = [], [], []
        for row, key in enumerate(token_keys):
            if key not in data:
                stats.drop("missing_image")
                continue
            img = load_image(data[key], model.resolution)
            if img is None:
                stats.drop("decode_error")
                continue
            keys.append(key)
            token_rows.append(row)
            pixels.append(img)
        side = model.resolution // 8
        latents = np.zeros((0, 4, side, side), np.float16)
        if pixels:
            stacked = np.stack(pixels)
            latents = np.concatenate(
                [
                    encode_images(vae, stacked[i : i + batch_size], model.scaling_factor)
                    for i in range(0, len(stacked), batch_size)
                ]
            )
        with atomic_path(root / source / STAGE / f"{shard}.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, latents)
        stats.num_out = len(keys)
        as32 = latents.astype(np.float32)
        stats.extra = {
            "model": model.name,
            "keys": keys,
            "token_rows": token_rows,
            "latent_mean": float(as32.mean()) if len(keys) else None,
            "latent_std": float(as32.std()) if len(keys) else None,
        }

    return run_shard(root, source, STAGE, shard, work)
