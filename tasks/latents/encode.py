"""encode: a shard's images -> VAE posterior mean x scaling factor -> fp16 `latents/NNNNN.npy`.

Row i of the latents is row i of `NNNNN.keys.arrow` (its key, token row: latent_keys.py). Stages
overlap so the VAE never waits for data: I/O thread -> feeder thread -> decode processes ->
pinned ring -> side-stream copy -> VAE. Batches always have `batch_size` rows (holes and padding
zeroed) and every op of the VAE is per image, so an image's latent is the same bits whatever
else its batch holds: a shard's latents do not depend on what was encoded before it.

A source's `LatentSpec` (VAE, bucket plan, views, channels: docs/training-data.md, "Latents on
disk") decides the layout. The legacy spec (the model's square, no flips, no log-variance)
writes the files above. Any other writes `latents/NNNNN.WxH.npy` fp16 [n, V, C, H/8, W/8] per
bucket present in the shard: each image goes to the bucket nearest its aspect ratio, resized to
cover it and center-cropped (in the decode workers, `images.decode_bucketed`); batches never
span buckets, but do span shards (a bucket's unfinished batch waits for the next shard's
images, so only the stream's last batch per bucket is padded); view 1 is the VAE's output on
the mirrored image; channels 4..7 the log-variance of the scaled posterior. A shard is done
only under the spec it was encoded with.

Here: the VAE per device, the stage's entry points, many devices and latent QA. Its parts:
encode_spec.py (the spec, when a shard is done), encode_read.py (a shard's inputs, streamed),
encode_pipeline.py (decode and batch), encode_write.py (a shard's files).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from catalog import Catalog, Model, needs_flips
from sdtrain.atomic import write_json_atomic
from sdtrain.lazy import BUILD_LOCK
from sdtrain.models import build_vae
from sdtrain.runtime import allow_recompiles
from tasks.latents import images, latent_keys
from tasks.latents.encode_pipeline import (
    Pipeline,
    cpu_lanes,
    in_inference_mode,
)
from tasks.latents.encode_read import read_images
from tasks.latents.encode_spec import STAGE, LatentSpec, shard_done
from tasks.latents.encode_write import finish_shard
from tasks.runtime.node import Node, close_nodes, local_node
from tasks.runtime.shards import ShardStats, read_stats, run_shard

QA_FILE = "qa.json"
PRECISIONS = ("bf16", "autocast", "fp32")  # see encode_precision
FLUSH_AFTER = 64  # batches: see flush_after_setting

_vaes: dict[tuple[str, str], torch.nn.Module] = {}
_encoders: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}
_lock = BUILD_LOCK  # shared with every lazy builder: see sdtrain/lazy.py
log = logging.getLogger(__name__)


class EncodeFailed(Exception):
    """An encoder process (one per device) failed; its shards are left undone."""


def spec_for(catalog: Catalog, source: str) -> LatentSpec:
    """A catalog source's latent spec: its model's bucket plan, flips when a phase mixing one of
    its datasets flips (`needs_flips`), the log-variance when it has `latent_sampling`."""
    src = catalog.source(source)
    return LatentSpec.of(
        catalog.model(src.model),
        flips=needs_flips(catalog, source),
        sampling=src.latent_sampling,
    )


def flush_after_setting(value: int | None = None) -> int:
    """How many batches a bucket's unfinished batch may wait, counted from its oldest image's
    arrival, before it is handed out as it is (padded to `batch_size`: one shape per bucket, so
    no new compiled shape and the same bits): `value`, else `SDPIPE_ENCODE_FLUSH_AFTER`, else
    FLUSH_AFTER. It bounds how long a shard's record waits on a rare bucket (docs/training-data.md,
    "Latents on disk")."""
    if value is None:
        value = int(os.environ.get("SDPIPE_ENCODE_FLUSH_AFTER") or FLUSH_AFTER)
    if value < 1:
        raise ValueError(f"encode flush_after {value}: at least 1 batch")
    return value


def load_image(data: bytes, size: int) -> np.ndarray | None:
    """RGB uint8 [size, size, 3] by the rules of tasks/latents/images.py; None if they drop it."""
    try:
        return images.decode_image(data, size)
    except images.Unusable:
        return None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_num_workers(device: torch.device) -> int:
    """Decode processes: on a GPU every core but the VAE's and the I/O threads'; on CPU one,
    since there the decoders take their cores from the VAE."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(16, cores - 2)) if device.type == "cuda" else 1


def _canonical(device: torch.device) -> torch.device:
    """`cuda` and `cuda:<current>` are one device: one VAE, one compiled encoder."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def encode_precision(device: torch.device, precision: str | None = None) -> str:
    """The VAE's numerics on `device`: `bf16`, its weights and activations in bf16 (a GPU's
    default: no fp32 copies of activations, no casts per layer); `autocast`, fp32 weights under
    bf16 autocast (sdpipe's GPU path before issue 28, kept as the benchmark's baseline; its
    GroupNorms run in fp32); `fp32` (the CPU's default)."""
    if precision is None:
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return "bf16" if bf16 else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"encode precision {precision!r}: one of {', '.join(PRECISIONS)}")
    return precision


def vae_for(model: Model, device: torch.device, precision: str | None = None) -> torch.nn.Module:
    """One frozen VAE per model, device, weights dtype and process, shared by shard tasks running
    in threads."""
    device = _canonical(device)
    dtype = torch.bfloat16 if encode_precision(device, precision) == "bf16" else torch.float32
    with _lock:
        key = (model.name, str(device), dtype)
        if key not in _vaes:
            vae = build_vae(model).eval().requires_grad_(False)
            if device.type == "cuda":
                # Batches arrive NHWC, the layout cuDNN's fastest bf16 convolutions use.
                vae = vae.to(memory_format=torch.channels_last)
            _vaes[key] = vae.to(device=device, dtype=dtype)
        return _vaes[key]


def _vae_input(x_BHWC: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> [B, 3, H, W] in [-1, 1], scaled in fp32 then cast to `dtype`; NHWC
    in memory, as it came."""
    return x_BHWC.permute(0, 3, 1, 2).float().div(127.5).sub(1.0).to(dtype)


def _numerics(vae: torch.nn.Module, precision: str | None):
    """(input dtype, autocast context) of an encoder over `vae` at `precision`."""
    weight = next(vae.parameters())
    autocast = (
        encode_precision(weight.device, precision) == "autocast" and weight.dtype == torch.float32
    )
    context = functools.partial(
        torch.autocast, weight.device.type, dtype=torch.bfloat16, enabled=autocast
    )
    return weight.dtype, context


def latent_encoder(
    vae: torch.nn.Module,
    scaling_factor: float,
    *,
    compile: bool = False,
    precision: str | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 [B, H, W, 3] on the VAE's device -> fp16 latents [B, 4, H/8, W/8] there.

    Pixels travel as uint8 (4x less to copy than float) and are scaled on the device; the VAE
    runs in its weights' dtype (bf16 on a GPU, fp32 on CPU: `encode_precision`), or under bf16
    autocast over fp32 weights (`precision="autocast"`).
    """
    dtype, autocast = _numerics(vae, precision)

    def encode(x_BHWC: torch.Tensor) -> torch.Tensor:
        with autocast():
            mean = vae.encode(_vae_input(x_BHWC, dtype)).latent_dist.mean
        return (mean.float() * scaling_factor).to(torch.float16)

    return _compiled(encode) if compile else encode


def view_encoder(
    vae: torch.nn.Module,
    scaling_factor: float,
    *,
    views: int = 1,
    channels: int = 4,
    compile: bool = False,
    precision: str | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 [B, H, W, 3] -> fp16 [B, V, C, H/8, W/8] on the VAE's device (the per-bucket
    layout). View 1 (views=2) is the VAE's output on the mirrored image, not a flip of view 0's
    latent; channels 4..7 (channels=8) are the log-variance of the scaled posterior, logvar +
    2 ln(scaling_factor), so a draw is mean + exp(logvar / 2) * eps."""
    dtype, autocast = _numerics(vae, precision)
    log_scale = 2 * math.log(scaling_factor)

    def encode(x_BHWC: torch.Tensor) -> torch.Tensor:
        x = _vae_input(x_BHWC, dtype)
        if views == 2:  # the width axis: image[:, ::-1] of each HWC image
            x = torch.cat([x, x.flip(3)])
        with autocast():
            posterior = vae.encode(x).latent_dist
        parts = [posterior.mean.float() * scaling_factor]
        if channels == 8:
            parts.append(posterior.logvar.float() + log_scale)
        z = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # [V * B, C, h, w]
        z = z.unflatten(0, (views, x_BHWC.shape[0])).transpose(0, 1)
        return z.to(torch.float16).contiguous()

    return _compiled(encode) if compile else encode


def _compiled(encode: Callable) -> Callable:
    """`encode` compiled per input shape (each bucket's batch is one shape), with room for every
    bucket of a plan before torch would fall back to eager."""
    allow_recompiles(64)
    return torch.compile(encode, dynamic=False)


def encoder_for(
    model: Model,
    device: torch.device,
    compile: bool = False,
    spec: LatentSpec | None = None,
    precision: str | None = None,
):
    """The process's encoder of `vae_for(model, device, precision)` for `spec` (default:
    legacy, `latent_encoder`; else `view_encoder`), compiled once if asked."""
    device = _canonical(device)
    precision = encode_precision(device, precision)
    vae = vae_for(model, device, precision)
    layout = None if spec is None or spec.legacy else (spec.views, spec.channels)
    with _lock:
        key = (model.name, str(device), compile, layout, precision)
        if key not in _encoders:
            if device.type == "cuda":
                # Batches of a shape repeat: let cuDNN time its algorithms once per shape.
                torch.backends.cudnn.benchmark = True
            options = dict(compile=compile, precision=precision)
            if layout is None:
                _encoders[key] = latent_encoder(vae, model.scaling_factor, **options)
            else:
                _encoders[key] = view_encoder(
                    vae, model.scaling_factor, views=layout[0], channels=layout[1], **options
                )
        return _encoders[key]


def release_device(device: str | torch.device) -> None:
    """Forget this process's VAEs and encoders on `device`: its holder gave it back, and the
    next one (another flow run, a training) gets its memory."""
    name = str(_canonical(torch.device(device)))
    with _lock:
        for cache in (_vaes, _encoders):
            for key in [k for k in cache if k[1] == name]:
                del cache[key]
    if torch.device(name).type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def encode_images(vae: torch.nn.Module, images_BHWC: np.ndarray, scaling_factor: float):
    """[N, H, W, 3] uint8 -> fp16 latents [N, 4, H/8, W/8] (posterior mean x scaling factor)."""
    device = next(vae.parameters()).device
    x = torch.from_numpy(images_BHWC).to(device)
    return latent_encoder(vae, scaling_factor)(x).cpu().numpy()


@torch.inference_mode()
def encode_pixels(
    model: Model,
    pixels_BHWC: torch.Tensor,
    *,
    batch_size: int = 32,
    compile: bool = False,
    precision: str | None = None,
) -> torch.Tensor:
    """The encoder alone, as the pipeline runs it, on pixels already in memory (on the device,
    uint8 [N, H, W, 3]): the pipeline's ceiling. fp16 latents [N, 4, H/8, W/8] on the device.
    """
    encode = encoder_for(model, pixels_BHWC.device, compile, precision=precision)
    batches = pixels_BHWC.split(batch_size)
    if pixels_BHWC.device.type != "cpu":
        return torch.cat([encode(b) for b in batches])
    lanes = cpu_lanes(torch.get_num_threads())
    return torch.cat(list(lanes.map(in_inference_mode(encode), batches)))


# ---- the pipeline ---------------------------------------------------------------------------


def encode_stream(
    root: Path,
    source: str,
    shards: Iterable[str],
    model: Model,
    *,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    num_workers: int | None = None,
    compile: bool = False,
    spec: LatentSpec | None = None,
    precision: str | None = None,
    flush_after: int | None = None,
    node: Node | None = None,
) -> Iterator[tuple[str, ShardStats | Exception]]:
    """Encode shards as they come through one pipeline, the next one's inputs read while one
    encodes: (shard, its stats record, or the error that failed it) in the order given.

    `shards` may block for the next shard (one long-lived encoder per device: a device worker
    of build-latents, flows/execution/devices.py). A shard whose inputs cannot be read or whose
    outputs cannot be written fails alone (its failure record written); shards done already are
    skipped. The record's `extra["device"]` names the device. `spec`: the latent layout
    (default `LatentSpec.of(model)`: the model's plan, one view, the mean; the flows pass
    `spec_for(catalog, source)`, which adds the catalog's flips and latent sampling); a shard
    done under another spec is encoded again. `flush_after`: batches a bucket's unfinished batch
    waits for more images (`flush_after_setting`). `node`: whose decode processes it uses
    (default: this process's, `local_node`).
    """
    device = _canonical(torch.device(device) if device is not None else default_device())
    spec = spec or LatentSpec.of(model)
    pipeline = Pipeline(
        root,
        source,
        shards,
        model,
        batch_size=batch_size,
        device=device,
        num_workers=num_workers or default_num_workers(device),
        spec=spec,
        make_encoder=functools.partial(encoder_for, model, device, compile, spec, precision),
        flush_after=flush_after_setting(flush_after),
        node=node or local_node(),
    )
    with pipeline:
        for encoded in pipeline.results():
            shard = encoded.job.shard
            finish = functools.partial(finish_shard, root, source, model, spec, device, encoded)
            try:
                stats = run_shard(root, source, STAGE, shard, finish, started=encoded.job.started)
            except Exception as e:
                yield shard, e
            else:
                yield shard, stats


def encode_shards(
    root: Path,
    source: str,
    shards: Sequence[str],
    model: Model,
    *,
    spec: LatentSpec | None = None,
    **options,
) -> list[ShardStats]:
    """Encode `shards` in order through one pipeline; shards already done (under `spec`,
    default `LatentSpec.of(model)`: the model's plan, no flips, the mean) are skipped. The first
    shard that fails raises (the shards before it are done). `options`: `encode_stream`'s
    keyword arguments (batch size, device, workers, compile, precision, flush, node)."""
    spec = spec or LatentSpec.of(model)
    if all(shard_done(root, source, s, spec) for s in shards):
        return [run_shard(root, source, STAGE, s, _never) for s in shards]
    done = []
    with contextlib.closing(encode_stream(root, source, shards, model, spec=spec, **options)) as s:
        for _, outcome in s:
            if isinstance(outcome, Exception):
                raise outcome
            done.append(outcome)
    return done


def _never(stats: ShardStats) -> None:
    raise AssertionError(f"{stats.shard} was done")


def encode_shard(root: Path, source: str, shard: str, model: Model, **options) -> ShardStats:
    """Encode one shard (`options`: `encode_stream`'s keyword arguments)."""
    return encode_shards(root, source, [shard], model, **options)[0]


# ---- many devices ---------------------------------------------------------------------------


def partition(shards: Sequence[str], num_parts: int) -> list[list[str]]:
    """Shards dealt round-robin, so neighbouring shards (often alike in size) spread out."""
    return [list(shards[i::num_parts]) for i in range(num_parts)]


def _encode_part(root, source, shards, model, device: str, threads: int, **kwargs) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(threads)
    try:
        encode_shards(root, source, shards, model, device=device, **kwargs)
    finally:
        # A multiprocessing child joins its children before exiting and never runs atexit.
        close_nodes()


def encode_on_devices(
    root: Path,
    source: str,
    shards: Sequence[str],
    model: Model,
    devices: Sequence[str],
    **options,
) -> list[ShardStats]:
    """One encoder process per device (e.g. every GPU of a machine), each on its share
    (`options`: `encode_stream`'s keyword arguments; decode workers default to the device's
    share of the cores, less one)."""
    cores = max(1, len(os.sched_getaffinity(0)) // len(devices))
    options["num_workers"] = options.get("num_workers") or max(1, cores - 1)
    ctx = multiprocessing.get_context("spawn")  # a process that holds CUDA cannot fork
    procs = [
        ctx.Process(
            target=_encode_part,
            args=(root, source, part, model, device, cores),
            kwargs=options,
            name=f"encode-{device}",
        )
        for device, part in zip(devices, partition(shards, len(devices)), strict=True)
        if part
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if failed := [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode != 0]:
        raise EncodeFailed(f"{', '.join(failed)} failed; the other shards are done")
    return [run_shard(root, source, STAGE, s, _never) for s in shards]


# ---- latent QA ------------------------------------------------------------------------------


@torch.inference_mode()
def latent_qa(
    root: Path,
    source: str,
    model: Model,
    *,
    num_samples: int = 8,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> dict:
    """Decode a stated sample of encoded images back through the VAE: reconstruction PSNR.

    The sample is the first `num_samples` of a permutation (seeded by `seed`) of every encoded
    (shard, row). PSNR compares the VAE decode with the transformed input, peak-to-peak 255;
    meaningful with real weights, computed either way. Written to `latents/qa.json`.
    """
    device = torch.device(device) if device is not None else default_device()
    records = read_stats(root, source, STAGE)
    chosen = latent_keys.sample(root, source, records, num_samples, seed)
    vae = vae_for(model, device)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    samples = []
    for shard in sorted({c[0] for c in chosen}):
        picked = [c for c in chosen if c[0] == shard]
        data = read_images(root / source / "shards" / f"{shard}.tar", {k for _, _, k in picked})
        table = latent_keys.read(root, source, shard)
        spec = latent_keys.spec(table)
        # One decode per latents file (the legacy file, or each bucket's: one shape each).
        groups: dict[str | None, list[tuple[int, str]]] = {}
        for _, row, key in picked:
            bucket, latent_row = latent_keys.locate(table, row)
            groups.setdefault(bucket, []).append((latent_row, key))
        psnr = {}
        for bucket, members in groups.items():
            latents = np.load(latent_keys.latents_path(root, source, shard, bucket), mmap_mode="r")
            z = np.stack([latents[i] for i, _ in members])
            if bucket is None:
                x = np.stack([images.decode_image(data[k], model.resolution) for _, k in members])
            else:  # view 0, the scaled mean (channels 0..3)
                z = z[:, 0, :4]
                x = np.stack(
                    [images.decode_to_bucket(data[k], spec["plan"])[1] for _, k in members]
                )
            z, x = torch.from_numpy(z.astype(np.float32)), torch.from_numpy(x)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                decoded = vae.decode(z.to(device) / model.scaling_factor).sample
            decoded = decoded.float().clamp(-1, 1).add(1).mul(127.5).cpu()
            mse = (decoded - x.permute(0, 3, 1, 2).float()).pow(2).mean(dim=(1, 2, 3))
            for (_, key), err in zip(members, mse.tolist(), strict=True):
                psnr[key] = 10 * math.log10(255**2 / err)
        samples += [{"shard": shard, "key": k, "psnr_db": psnr[k]} for *_, k in picked]
    counts = np.array([s.num_out for s in records], np.float64)
    means = np.array([s.extra["latent_mean"] or 0.0 for s in records])
    stds = np.array([s.extra["latent_std"] or 0.0 for s in records])
    total = counts.sum()
    mean = float((counts * means).sum() / total) if total else None
    qa = {
        "model": model.name,
        "seed": seed,
        "num_latents": int(total),
        "latent_mean": mean,
        "latent_std": (
            float(np.sqrt((counts * (stds**2 + means**2)).sum() / total - mean**2))
            if total
            else None
        ),
        "psnr_db_mean": float(np.mean([s["psnr_db"] for s in samples])) if samples else None,
        "samples": samples,
    }
    write_json_atomic(root / source / STAGE / QA_FILE, qa)
    return qa
