"""encode: a shard's images -> VAE posterior mean x scaling factor -> fp16 `latents/NNNNN.npy`.

Row i of the latents is row i of `NNNNN.keys.arrow` (its key, token row: tasks/latent_keys). Stages
overlap so the VAE never waits for data: I/O thread -> feeder thread -> decode processes ->
pinned ring -> side-stream copy -> VAE. Batches never span shards and always have `batch_size`
rows (holes zeroed), so a shard's latents are the same bits whatever was encoded before it.

A source's `LatentSpec` (VAE, bucket plan, views, channels: docs/training-data.md, "Latents on
disk") decides the layout. The legacy spec (the model's square, no flips, no log-variance)
writes the files above. Any other writes `latents/NNNNN.WxH.npy` fp16 [n, V, C, H/8, W/8] per
bucket present in the shard: each image goes to the bucket nearest its aspect ratio, resized to
cover it and center-cropped (in the decode workers, `images.decode_bucketed`); batches never
span buckets either; view 1 is the VAE's output on the mirrored image; channels 4..7 the
log-variance of the scaled posterior. A shard is done only under the spec it was encoded with.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import io
import json
import logging
import math
import multiprocessing
import os
import queue
import tarfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from catalog import Catalog, Model, needs_flips
from catalog.buckets import BucketPlan
from sdtrain.atomic import atomic_path, write_json_atomic
from sdtrain.lazy import BUILD_LOCK
from sdtrain.models import build_vae
from tasks.latents import images, latent_keys
from tasks.runtime.shards import ShardStats, done_record, read_stats, run_shard, stats_path

STAGE = "latents"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
DECODE_AHEAD = 128  # images handed to the decoders before the VAE asks for them
DRAIN_AFTER_S = 0.1  # no batch came this long: finish those in flight (see _Pipeline.results)
QA_FILE = "qa.json"

_vaes: dict[tuple[str, str], torch.nn.Module] = {}
_encoders: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}
_pools: dict[int, images.DecodePool] = {}
_lanes: dict[int, ThreadPoolExecutor] = {}
_lock = BUILD_LOCK  # shared with every lazy builder: see sdtrain/lazy.py
log = logging.getLogger(__name__)


class EncodeFailed(Exception):
    """An encoder process (one per device) failed; its shards are left undone."""


@dataclass(frozen=True, slots=True)
class LatentSpec:
    """What a source's latents are encoded under: the VAE (`vae_identity`), the bucket plan,
    views (1, or 2 with the mirrored image) and channels (4: the scaled mean; 8: and its
    log-variance). Portable: no path, host or mtime, so a copied data root is done elsewhere.
    `legacy`: the model's one square, 1 view, 4 channels (today's `NNNNN.npy` layout)."""

    vae: dict
    plan: BucketPlan
    views: int = 1
    channels: int = 4
    legacy: bool = True

    @classmethod
    def of(cls, model: Model, *, flips: bool = False, sampling: bool = False) -> LatentSpec:
        plan = BucketPlan.from_dict(model.buckets, model.resolution)
        views, channels = (2 if flips else 1), (8 if sampling else 4)
        square = plan.is_square and plan.sizes()[0].tolist() == [model.resolution] * 2
        return cls(
            vae=vae_identity(model),
            plan=plan,
            views=views,
            channels=channels,
            legacy=square and views == 1 and channels == 4,
        )

    def to_dict(self) -> dict:
        plan = self.plan.to_dict()
        plan["max_aspect"] = float(plan["max_aspect"])  # 2 and 2.0 are one plan
        return {"vae": self.vae, "plan": plan, "views": self.views, "channels": self.channels}

    def digest(self) -> str:
        """A short digest of `to_dict()`: part of the encode task's cache key."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __hash__(self) -> int:  # `vae` is a dict
        return hash(self.digest())


def vae_identity(model: Model) -> dict:
    """The VAE a latent was made by: the model's name, its pretrained weights as the catalog
    names them (a repo id or folder) or a digest of its config, and the scaling factor."""
    weights = model.vae_pretrained or (
        "config-sha256:"
        + hashlib.sha256(json.dumps(model.vae_config, sort_keys=True).encode()).hexdigest()[:16]
    )
    return {"model": model.name, "weights": weights, "scaling_factor": model.scaling_factor}


def spec_for(catalog: Catalog, source: str) -> LatentSpec:
    """A catalog source's latent spec: its model's bucket plan, flips when a phase mixing one of
    its datasets flips (`needs_flips`), the log-variance when it has `latent_sampling`."""
    src = catalog.source(source)
    return LatentSpec.of(
        catalog.model(src.model),
        flips=needs_flips(catalog, source),
        sampling=src.latent_sampling,
    )


def shard_done(root: Path, source: str, shard: str, spec: LatentSpec) -> bool:
    """The shard's record is there, its outputs intact (`done_record`), and it was encoded under
    `spec`: a shard encoded under another spec is not done."""
    record = done_record(root, source, STAGE, shard)
    return record is not None and _encoded_under(record, spec)


def _encoded_under(record: ShardStats, spec: LatentSpec) -> bool:
    recorded = record.extra.get("latent_spec")
    if recorded is None:  # written before specs were recorded: the legacy layout
        return spec.legacy
    if recorded != spec.to_dict():
        return False
    if spec.legacy:
        return True
    # The keys file and every bucket file it names: among the outputs `done_record` checked.
    named = [f"{record.shard}{latent_keys.SUFFIX}"]
    named += [f"{record.shard}.{b}.npy" for b in record.extra.get("buckets", {})]
    return all(n in record.outputs for n in named)


def _forget_other_spec(root: Path, source: str, shard: str, spec: LatentSpec) -> bool:
    """True if the shard is done under `spec`; a record of another spec is removed (with a
    warning), so the shard is encoded again."""
    record = done_record(root, source, STAGE, shard)
    if record is None:
        return False
    if _encoded_under(record, spec):
        return True
    log.warning("encode %s/%s: encoded under another latent spec; encoding it again", source, shard)
    stats_path(root, source, STAGE, shard).unlink(missing_ok=True)
    return False


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


def vae_for(model: Model, device: torch.device) -> torch.nn.Module:
    """One frozen VAE per model, device and process, shared by shard tasks running in threads."""
    device = _canonical(device)
    with _lock:
        key = (model.name, str(device))
        if key not in _vaes:
            vae = build_vae(model).eval().requires_grad_(False)
            if device.type == "cuda":
                # Batches arrive NHWC, the layout cuDNN's fastest bf16 convolutions use.
                vae = vae.to(memory_format=torch.channels_last)
            _vaes[key] = vae.to(device)
        return _vaes[key]


def latent_encoder(
    vae: torch.nn.Module, scaling_factor: float, *, compile: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 [B, H, W, 3] on the VAE's device -> fp16 latents [B, 4, H/8, W/8] there.

    Pixels travel as uint8 (4x less to copy than float) and are scaled on the device; bf16
    autocast on a GPU, fp32 on CPU.
    """
    device = next(vae.parameters()).device
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    def encode(x_BHWC: torch.Tensor) -> torch.Tensor:
        x = x_BHWC.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            mean = vae.encode(x).latent_dist.mean
        return (mean.float() * scaling_factor).to(torch.float16)

    return torch.compile(encode, dynamic=False) if compile else encode


def view_encoder(
    vae: torch.nn.Module,
    scaling_factor: float,
    *,
    views: int = 1,
    channels: int = 4,
    compile: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 [B, H, W, 3] -> fp16 [B, V, C, H/8, W/8] on the VAE's device (the per-bucket
    layout). View 1 (views=2) is the VAE's output on the mirrored image, not a flip of view 0's
    latent; channels 4..7 (channels=8) are the log-variance of the scaled posterior, logvar +
    2 ln(scaling_factor), so a draw is mean + exp(logvar / 2) * eps."""
    device = next(vae.parameters()).device
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    log_scale = 2 * math.log(scaling_factor)

    def encode(x_BHWC: torch.Tensor) -> torch.Tensor:
        x = x_BHWC.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
        if views == 2:  # the width axis: image[:, ::-1] of each HWC image
            x = torch.cat([x, x.flip(3)])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            posterior = vae.encode(x).latent_dist
        parts = [posterior.mean.float() * scaling_factor]
        if channels == 8:
            parts.append(posterior.logvar.float() + log_scale)
        z = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # [V * B, C, h, w]
        z = z.unflatten(0, (views, x_BHWC.shape[0])).transpose(0, 1)
        return z.to(torch.float16).contiguous()

    return torch.compile(encode, dynamic=False) if compile else encode


def encoder_for(
    model: Model, device: torch.device, compile: bool = False, spec: LatentSpec | None = None
):
    """The process's encoder of `vae_for(model, device)` for `spec` (default: legacy,
    `latent_encoder`; else `view_encoder`), compiled once if asked."""
    device = _canonical(device)
    vae = vae_for(model, device)
    layout = None if spec is None or spec.legacy else (spec.views, spec.channels)
    with _lock:
        key = (model.name, str(device), compile, layout)
        if key not in _encoders:
            if device.type == "cuda":
                # Batches of a shape repeat: let cuDNN time its algorithms once per shape.
                torch.backends.cudnn.benchmark = True
            if layout is None:
                _encoders[key] = latent_encoder(vae, model.scaling_factor, compile=compile)
            else:
                _encoders[key] = view_encoder(
                    vae, model.scaling_factor, views=layout[0], channels=layout[1], compile=compile
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


def _decode_pool(num_workers: int) -> images.DecodePool:
    """Decode processes, one pool per size and process, kept for every later shard."""
    with _lock:
        if num_workers not in _pools:
            _pools[num_workers] = images.DecodePool(num_workers)
        return _pools[num_workers]


def cpu_lanes(num_lanes: int) -> ThreadPoolExecutor:
    """CPU encode lanes: `num_lanes` single-threaded encoders side by side, one per core.

    Not one encode over all cores: its threads meet at a barrier after every op, so a decode
    process that preempts one of them stalls them all, while it slows only one lane.
    """
    with _lock:
        if num_lanes not in _lanes:
            started = threading.Barrier(num_lanes + 1)
            default = torch.get_num_threads()
            lanes = ThreadPoolExecutor(
                num_lanes,
                thread_name_prefix="encode-lane",
                initializer=_single_threaded,
                initargs=(started,),
            )
            for _ in range(num_lanes):
                lanes.submit(int)  # starts a thread per lane: each waits at the barrier
            started.wait()
            # set_num_threads is per thread, but also sets the default of threads to come.
            torch.set_num_threads(default)
            _lanes[num_lanes] = lanes
        return _lanes[num_lanes]


def _single_threaded(started: threading.Barrier) -> None:
    torch.get_num_threads()  # torch's per-thread setup first, or it would undo the next line
    torch.set_num_threads(1)
    started.wait()


@atexit.register
def _shutdown_pools() -> None:
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


@torch.inference_mode()
def encode_pixels(
    model: Model,
    pixels_BHWC: torch.Tensor,
    *,
    batch_size: int = 32,
    compile: bool = False,
) -> torch.Tensor:
    """The encoder alone, as the pipeline runs it, on pixels already in memory (on the device,
    uint8 [N, H, W, 3]): the pipeline's ceiling. fp16 latents [N, 4, H/8, W/8] on the device.
    """
    encode = encoder_for(model, pixels_BHWC.device, compile)
    batches = pixels_BHWC.split(batch_size)
    if pixels_BHWC.device.type != "cpu":
        return torch.cat([encode(b) for b in batches])
    lanes = cpu_lanes(torch.get_num_threads())
    return torch.cat(list(lanes.map(_inference(encode), batches)))


def _inference(fn):
    """`fn` in inference mode, which is per thread: for the lanes."""

    def run(*args):
        with torch.inference_mode():
            return fn(*args)

    return run


def extract_images(tar_bytes: bytes, keys: set[str]) -> dict[str, bytes]:
    """The image bytes of `keys` from a webdataset tar held in memory."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar:
            key, _, ext = member.name.partition(".")
            if key in keys and ext.lower() in IMAGE_EXTENSIONS and member.isfile():
                out[key] = tar.extractfile(member).read()
    return out


def read_images(tar_path: Path, keys: set[str]) -> dict[str, bytes]:
    """The image bytes of `keys` from a webdataset tar."""
    return extract_images(tar_path.read_bytes(), keys)


# ---- the pipeline ---------------------------------------------------------------------------

_END = object()  # a producer thread is finished
_SHARD_END = object()  # the feeder handed out a (bucketed) shard's last batch


@dataclass(slots=True)
class _ShardInput:
    shard: str
    token_keys: list[str]
    tar_bytes: bytes
    error: Exception | None = None  # its inputs could not be read: this shard fails, alone
    skip: bool = False  # done already
    sha256: list[str] | None = None  # per token key (bucketed layout), "" when unknown


@dataclass(slots=True)
class _ShardJob:
    """A shard's images found in its tar, in token order; its batches follow it."""

    shard: str
    num_in: int
    keys: list[str]
    token_rows: list[int]
    num_batches: int  # bucketed: -1 until the feeder has handed out its last batch
    error: Exception | None = None
    skip: bool = False
    started: float = 0.0  # when its images began to be handed out (its record's seconds)
    sha256: list[str] | None = None  # per key (bucketed layout)
    dropped: dict[int, str] = field(default_factory=dict)  # bucketed: filled by the feeder


@dataclass(slots=True)
class _Batch:
    job: _ShardJob
    start: int  # index of its first image in job.keys (legacy)
    size: int
    futures: list[Future]
    # The bucketed layout: its bucket (index into the plan's sizes), its images' indices in
    # job.keys and their pixels [H, W, 3] of that bucket, decoded already.
    bucket: int = -1
    rows: np.ndarray | None = None
    pixels: list[np.ndarray] | None = None


@dataclass(slots=True)
class _Encoded:
    job: _ShardJob
    latents: np.ndarray | None  # legacy: fp16 [len(job.keys), 4, h, w]; dropped rows are junk
    dropped: dict[int, str] = field(default_factory=dict)  # index in job.keys -> reason
    num_batches_done: int = 0
    data_wait_s: float = 0.0
    # The bucketed layout: bucket -> its batches' (indices in job.keys, fp16 [n, V, C, h, w]).
    parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.num_batches_done == self.job.num_batches


class _Ring:
    """Host batches the decoders' pixels are gathered in, and their encode.

    On a GPU they are pinned and each is copied on a side stream, overlapping the encode of the
    batch before it; a slot is refilled once its copy has finished. On CPU `lanes` batches are
    encoded at once, one per core (`cpu_lanes`). A slot holds `batch_size` images of up to
    `max_pixels` pixels (the plan's largest bucket), viewed per batch as [B, H, W, 3].
    """

    def __init__(
        self,
        encode,
        device: torch.device,
        batch_size: int,
        max_pixels: int,
        out_per_pixel: float,
    ):
        self.encode_fn, self.device = encode, device
        cuda = device.type == "cuda"
        num_lanes = torch.get_num_threads()
        self.lanes = None if cuda else cpu_lanes(num_lanes)
        self.depth = 1 if cuda else num_lanes  # batches encoding at once
        num_slots = self.depth + 2  # + one filling + one spare
        self.host = [
            torch.empty(batch_size * max_pixels * 3, dtype=torch.uint8, pin_memory=cuda)
            for _ in range(num_slots)
        ]
        self.views: list[torch.Tensor | None] = [None] * num_slots
        out_size = math.ceil(batch_size * max_pixels * out_per_pixel)
        self.out = [
            torch.empty(out_size, dtype=torch.float16, pin_memory=True)
            for _ in range(num_slots if cuda else 0)
        ]
        self.copied: list[torch.cuda.Event | None] = [None] * num_slots
        self.copy_stream = torch.cuda.Stream(device) if cuda else None

    def __len__(self) -> int:
        return len(self.host)

    def slot(self, i: int, shape: tuple[int, int, int, int]) -> np.ndarray:
        """Slot i, free to fill, as a batch of `shape` [B, H, W, 3]."""
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        self.views[i] = self.host[i][: math.prod(shape)].view(shape)
        return self.views[i].numpy()

    def submit(self, i: int):
        """Start encoding slot i; returns what `result` needs."""
        if self.lanes is not None:
            return self.lanes.submit(_inference(self.encode_fn), self.views[i])
        with torch.cuda.device(self.device), torch.inference_mode():
            compute = torch.cuda.current_stream()
            with torch.cuda.stream(self.copy_stream):
                x = self.views[i].to(self.device, non_blocking=True)
            self.copied[i] = self.copy_stream.record_event()
            compute.wait_event(self.copied[i])
            x.record_stream(compute)  # x was allocated on the copy stream, used on this one
            z = self.encode_fn(x)
            out = self.out[i][: z.numel()].view(z.shape)
            out.copy_(z, non_blocking=True)
            return out, compute.record_event()

    def result(self, handle) -> np.ndarray:
        if self.lanes is not None:
            return handle.result().numpy()
        out, done = handle
        done.synchronize()
        return out.numpy()


class _Pipeline:
    """The encode of shards as they come: `results()` yields each shard's latents, in order.

    `shards` may be an iterator that blocks until the next shard is given (a device worker of
    build-latents, flows/devices.py): the I/O thread waits on it while the VAE works.
    """

    def __init__(
        self, root, source, shards, model, *, batch_size, device, num_workers, compile, spec
    ):
        self.root, self.source, self.shards, self.model = root, source, shards, model
        self.spec: LatentSpec = spec
        self.bucketed = not spec.legacy
        self.batch_size, self.size = batch_size, model.resolution
        self.sizes = spec.plan.sizes()  # [K, 2] (width, height)
        self.plan = spec.plan.to_dict()
        self.pool = _decode_pool(num_workers)
        self.num_workers = num_workers
        self.chunk = math.ceil(batch_size / num_workers)  # images per decode task
        if self.bucketed:
            max_pixels = int((self.sizes[:, 0] * self.sizes[:, 1]).max())
            out_per_pixel = spec.views * spec.channels / 64
        else:
            max_pixels, out_per_pixel = self.size * self.size, 4 / 64
        self.ring = _Ring(
            encoder_for(model, device, compile, spec),
            device,
            batch_size,
            max_pixels,
            out_per_pixel,
        )
        self.inputs: queue.Queue = queue.Queue(maxsize=1)
        ahead = max(2, DECODE_AHEAD // batch_size)  # batches; shard headers ride along
        self.batches: queue.Queue = queue.Queue(maxsize=ahead)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.ended = False
        self.threads = [
            threading.Thread(target=self._prefetch, name="encode-prefetch", daemon=True),
            threading.Thread(target=self._feed, name="encode-feed", daemon=True),
        ]

    def __enter__(self) -> _Pipeline:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        # Stop the producers: each one drains its input until the END of the one before it,
        # so none stays blocked on a full queue.
        self.stop.set()
        while not self.ended:
            item = self.batches.get()
            self.ended = item is _END
            if isinstance(item, _Batch):
                for f in item.futures:
                    f.cancel()
        for t in self.threads:
            t.join()

    def _prefetch(self) -> None:
        """I/O thread: the next shard's token keys and whole tar, read while this one encodes."""
        try:
            for shard in self.shards:
                if self.stop.is_set():
                    break
                if _forget_other_spec(self.root, self.source, shard, self.spec):
                    self.inputs.put(_ShardInput(shard, [], b"", skip=True))
                    continue
                try:
                    tokens = self.root / self.source / "tokens" / f"{shard}.parquet"
                    keys = pq.read_table(tokens, columns=["key"])["key"].to_pylist()
                    tar = self.root / self.source / "shards" / f"{shard}.tar"
                    item = _ShardInput(shard, keys, tar.read_bytes())
                    if self.bucketed:
                        item.sha256 = _sample_digests(self.root, self.source, shard, keys)
                except Exception as e:  # this shard's inputs: its failure, not the others'
                    item = _ShardInput(shard, [], b"", error=e)
                self.inputs.put(item)
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.inputs.put(_END)

    def _feed(self) -> None:
        """Feeder thread: extract a shard's images and hand its batches to the decoders."""
        try:
            while (item := self.inputs.get()) is not _END:
                if not self.stop.is_set():
                    self._dispatch(item)
        except BaseException as e:
            self.errors.append(e)
            while self.inputs.get() is not _END:
                pass
        finally:
            self.batches.put(_END)

    def _dispatch(self, item: _ShardInput) -> None:
        started = time.perf_counter()
        data, error = {}, item.error
        if error is None and not item.skip:
            try:
                data = extract_images(item.tar_bytes, set(item.token_keys))
            except Exception as e:  # a broken tar fails its shard only
                error = e
        if error is not None or item.skip:
            job = _ShardJob(item.shard, 0, [], [], 0, error, item.skip, started)
            self.batches.put(job)
            return
        present = [(row, key) for row, key in enumerate(item.token_keys) if key in data]
        job = _ShardJob(
            shard=item.shard,
            num_in=len(item.token_keys),
            keys=[key for _, key in present],
            token_rows=[row for row, _ in present],
            num_batches=-1 if self.bucketed else math.ceil(len(present) / self.batch_size),
            started=started,
        )
        if self.bucketed:
            job.sha256 = [item.sha256[row] for row, _ in present]
            self._dispatch_bucketed(job, data)
            return
        self.batches.put(job)
        for start in range(0, len(present), self.batch_size):
            if self.stop.is_set():
                return
            items = [
                (i, data[key]) for i, key in enumerate(job.keys[start : start + self.batch_size])
            ]
            futures = [
                self.pool.submit(items[j : j + self.chunk], self.size)
                for j in range(0, len(items), self.chunk)
            ]
            self.batches.put(_Batch(job, start, len(items), futures))

    def _dispatch_bucketed(self, job: _ShardJob, data: dict[str, bytes]) -> None:
        """A shard's images decoded into their buckets (in the decode workers), gathered per
        bucket in key order and handed out a full batch at a time; each bucket's last, short
        batch at the shard's end. A bounded number of decode tasks is in flight, and at most a
        batch less one image waits per bucket."""
        self.batches.put(job)
        waiting: dict[int, list[tuple[int, np.ndarray]]] = {}
        in_flight: deque[Future] = deque()
        limit = max(2 * self.num_workers, DECODE_AHEAD // self.chunk)
        num_batches = 0

        def hand_out(bucket: int) -> None:
            nonlocal num_batches
            rows = np.array([r for r, _ in waiting[bucket]], np.int64)
            pixels = [p for _, p in waiting[bucket]]
            waiting[bucket] = []
            self.batches.put(_Batch(job, -1, len(rows), [], bucket, rows, pixels))
            num_batches += 1

        def take_oldest() -> None:
            rows, payload, dropped = in_flight.popleft().result()
            job.dropped.update(dropped)
            for row, (bucket, pixels) in zip(rows, payload, strict=True):
                waiting.setdefault(bucket, []).append((row, pixels))
                if len(waiting[bucket]) == self.batch_size:
                    hand_out(bucket)

        for start in range(0, len(job.keys), self.chunk):
            if self.stop.is_set():
                for f in in_flight:
                    f.cancel()
                return
            items = [
                (i, data[job.keys[i]]) for i in range(start, min(len(job.keys), start + self.chunk))
            ]
            in_flight.append(self.pool.submit(items, self.size, "bucketed", plan=self.plan))
            while len(in_flight) > limit:
                take_oldest()
        while in_flight:
            take_oldest()
        for bucket in sorted(waiting):
            if waiting[bucket]:
                hand_out(bucket)
        job.num_batches = num_batches  # before the marker: the VAE's thread reads it after
        self.batches.put(_SHARD_END)

    def results(self) -> Iterator[_Encoded]:
        """The calling thread's loop: fill a ring slot, start its encode, collect the one before."""
        order: deque[_Encoded] = deque()  # shards begun, in order
        in_flight: deque[tuple[_Batch, _Encoded, object]] = deque()
        num_submitted = 0
        while True:
            t0 = time.perf_counter()
            try:
                item = self.batches.get(timeout=DRAIN_AFTER_S)
            except queue.Empty:
                # Nothing comes: finish the batches in flight, so a shard all submitted is
                # yielded now, not when the next shard comes (it may wait on this one's result).
                while in_flight:
                    self._collect(*in_flight.popleft())
                yield from self._pop_complete(order)
                item = self.batches.get()
            if item is _END:
                self.ended = True
                if self.errors:
                    raise self.errors[0]
                while in_flight:
                    self._collect(*in_flight.popleft())
                yield from self._pop_complete(order)
                return
            if item is _SHARD_END:
                yield from self._pop_complete(order)
                continue
            if isinstance(item, _ShardJob):
                latents = None
                if not self.bucketed:
                    side = self.size // 8
                    latents = np.empty((len(item.keys), 4, side, side), np.float16)
                order.append(_Encoded(item, latents))
                yield from self._pop_complete(order)
                continue
            encoded = order[-1]
            slot = num_submitted % len(self.ring)
            if self.bucketed:
                width, height = self.sizes[item.bucket].tolist()
                host = self.ring.slot(slot, (self.batch_size, height, width, 3))
                self._fill_bucketed(host, item)
            else:
                host = self.ring.slot(slot, (self.batch_size, self.size, self.size, 3))
                self._fill(host, item, encoded)
            encoded.data_wait_s += time.perf_counter() - t0
            in_flight.append((item, encoded, self.ring.submit(slot)))
            num_submitted += 1
            while len(in_flight) > self.ring.depth:
                self._collect(*in_flight.popleft())
            yield from self._pop_complete(order)

    def _fill(self, host: np.ndarray, batch: _Batch, encoded: _Encoded) -> None:
        filled = np.zeros(len(host), bool)
        for future in batch.futures:
            rows, pixels, dropped = future.result()
            if rows and rows[-1] - rows[0] + 1 == len(rows):  # no hole: one block copy
                host[rows[0] : rows[-1] + 1] = pixels
            else:
                host[rows] = pixels
            filled[rows] = True
            for row, reason in dropped.items():
                encoded.dropped[batch.start + row] = reason
        # Holes and padding are zeros, not what the slot held before: same batch, same bits.
        host[~filled] = 0

    @staticmethod
    def _fill_bucketed(host: np.ndarray, batch: _Batch) -> None:
        for i, pixels in enumerate(batch.pixels):
            host[i] = pixels
        host[batch.size :] = 0  # padding: zeros, whatever the slot held before

    def _collect(self, batch: _Batch, encoded: _Encoded, handle) -> None:
        latents = self.ring.result(handle)
        if self.bucketed:
            part = (batch.rows, latents[: batch.size].copy())  # the slot's buffer is reused
            encoded.parts.setdefault(batch.bucket, []).append(part)
        else:
            encoded.latents[batch.start : batch.start + batch.size] = latents[: batch.size]
        encoded.num_batches_done += 1

    @staticmethod
    def _pop_complete(order: deque[_Encoded]) -> Iterator[_Encoded]:
        while order and order[0].complete:
            yield order.popleft()


def _sample_digests(root: Path, source: str, shard: str, keys: list[str]) -> list[str]:
    """The sha256 of each key's image bytes from the shard's sample table
    (`shards/NNNNN.parquet`), "" where the table, its column or the key is missing."""
    table_path = root / source / "shards" / f"{shard}.parquet"
    try:
        names = pq.read_schema(table_path).names
    except FileNotFoundError:
        return [""] * len(keys)
    if "key" not in names or "sha256" not in names:
        return [""] * len(keys)
    table = pq.read_table(table_path, columns=["key", "sha256"])
    where = pc.index_in(pa.array(keys, pa.string()), value_set=table["key"].combine_chunks())
    digests = table["sha256"].combine_chunks().cast(pa.string()).take(where)
    return pc.fill_null(digests, "").to_pylist()


def _remove_stale(root: Path, source: str, shard: str, keep: set[str]) -> None:
    """Latent files of the shard not written now (another spec's buckets, or its legacy file)."""
    folder = root / source / STAGE
    for p in [*folder.glob(f"{shard}.npy"), *folder.glob(f"{shard}.*.npy")]:
        if p.name not in keep:
            p.unlink(missing_ok=True)


def _commit(
    root: Path, source: str, model: Model, spec: LatentSpec, encoded: _Encoded, stats: ShardStats
):
    job = encoded.job
    if job.shard != stats.shard:  # the pipeline yields shards in the order it was given them
        raise RuntimeError(f"encode: got shard {job.shard} for {stats.shard}")
    if not spec.legacy:
        _commit_bucketed(root, source, model, spec, encoded, stats)
        return
    stats.num_in = job.num_in
    if missing := job.num_in - len(job.keys):
        stats.drop("missing_image", missing)
    for reason, n in sorted(Counter(encoded.dropped.values()).items()):
        stats.drop(reason, n)
    kept = [i for i in range(len(job.keys)) if i not in encoded.dropped]
    latents = encoded.latents[kept]
    with atomic_path(root / source / STAGE / f"{job.shard}.npy") as tmp, open(tmp, "wb") as f:
        np.save(f, latents)
    stats.num_out = len(kept)
    as32 = latents.astype(np.float32)
    latent_keys.write(
        root, source, job.shard, [job.keys[i] for i in kept], [job.token_rows[i] for i in kept]
    )
    _remove_stale(root, source, job.shard, {f"{job.shard}.npy"})
    stats.extra = {
        "model": model.name,
        "latent_mean": float(as32.mean()) if kept else None,
        "latent_std": float(as32.std()) if kept else None,
        "data_wait_seconds": round(encoded.data_wait_s, 3),
        "latent_spec": spec.to_dict(),
    }


def _commit_bucketed(
    root: Path, source: str, model: Model, spec: LatentSpec, encoded: _Encoded, stats: ShardStats
):
    """`NNNNN.WxH.npy` per bucket present, then the keys file naming each row's bucket and row
    there; latent_mean/std are those of view 0's scaled mean (channels 0..3), as the legacy's."""
    job = encoded.job
    stats.num_in = job.num_in
    if missing := job.num_in - len(job.keys):
        stats.drop("missing_image", missing)
    for reason, n in sorted(Counter(job.dropped.values()).items()):
        stats.drop(reason, n)
    names = spec.plan.names()
    bucket_of = np.full(len(job.keys), -1, np.int64)
    bucket_row = np.full(len(job.keys), -1, np.int64)
    counts: dict[str, int] = {}
    total, sums = 0, np.zeros(2, np.float64)
    for bucket in sorted(encoded.parts):
        parts = encoded.parts[bucket]
        rows = np.concatenate([r for r, _ in parts])
        latents = np.concatenate([z for _, z in parts])
        bucket_of[rows] = bucket
        bucket_row[rows] = np.arange(len(rows))
        final = latent_keys.latents_path(root, source, job.shard, names[bucket])
        with atomic_path(final) as tmp, open(tmp, "wb") as f:
            np.save(f, latents)
        counts[names[bucket]] = len(rows)
        mean = latents[:, 0, :4].astype(np.float32)
        total += mean.size
        sums += (mean.sum(dtype=np.float64), np.square(mean, dtype=np.float64).sum())
    kept = np.flatnonzero(bucket_of >= 0)
    table = latent_keys.bucketed_table(
        [job.keys[i] for i in kept],
        [job.token_rows[i] for i in kept],
        [names[b] for b in bucket_of[kept]],
        bucket_row[kept],
        [job.sha256[i] for i in kept],
        latent_keys.tokens_path(root, source, job.shard),
        spec.to_dict(),
    )
    latent_keys.write_table(latent_keys.path(root, source, job.shard), table)
    _remove_stale(root, source, job.shard, {f"{job.shard}.{b}.npy" for b in counts})
    stats.num_out = len(kept)
    mean = sums[0] / total if total else None
    stats.extra = {
        "model": model.name,
        "latent_mean": float(mean) if total else None,
        "latent_std": float(np.sqrt(max(0.0, sums[1] / total - mean**2))) if total else None,
        "data_wait_seconds": round(encoded.data_wait_s, 3),
        "latent_spec": spec.to_dict(),
        "buckets": counts,
    }


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
) -> Iterator[tuple[str, ShardStats | Exception]]:
    """Encode shards as they come through one pipeline, the next one's inputs read while one
    encodes: (shard, its stats record, or the error that failed it) in the order given.

    `shards` may block for the next shard (one long-lived encoder per device: a device worker
    of build-latents, flows/devices.py). A shard whose inputs cannot be read or whose outputs
    cannot be written fails alone (its failure record written); shards done already are
    skipped. The record's `extra["device"]` names the device. `spec`: the latent layout
    (default `LatentSpec.of(model)`: the model's plan, one view, the mean; the flows pass
    `spec_for(catalog, source)`, which adds the catalog's flips and latent sampling); a shard
    done under another spec is encoded again.
    """
    device = _canonical(torch.device(device) if device is not None else default_device())
    spec = spec or LatentSpec.of(model)
    pipeline = _Pipeline(
        root,
        source,
        shards,
        model,
        batch_size=batch_size,
        device=device,
        num_workers=num_workers or default_num_workers(device),
        compile=compile,
        spec=spec,
    )
    with pipeline:
        for encoded in pipeline.results():
            shard = encoded.job.shard
            finish = functools.partial(_finish, root, source, model, spec, device, encoded)
            try:
                stats = run_shard(root, source, STAGE, shard, finish, started=encoded.job.started)
            except Exception as e:
                yield shard, e
            else:
                yield shard, stats


def _finish(root, source, model, spec, device, encoded: _Encoded, stats: ShardStats) -> None:
    if encoded.job.error is not None:
        raise encoded.job.error
    if encoded.job.skip:  # its record was there when its inputs were read
        raise RuntimeError(f"encode: {stats.shard}'s record vanished while encoding")
    _commit(root, source, model, spec, encoded, stats)
    stats.extra["device"] = str(device)


def encode_shards(
    root: Path,
    source: str,
    shards: Sequence[str],
    model: Model,
    *,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    num_workers: int | None = None,
    compile: bool = False,
    spec: LatentSpec | None = None,
) -> list[ShardStats]:
    """Encode `shards` in order through one pipeline; shards already done (under `spec`,
    default `LatentSpec.of(model)`: the model's plan, no flips, the mean) are skipped. The first
    shard that fails raises (the shards before it are done)."""
    spec = spec or LatentSpec.of(model)
    if all(shard_done(root, source, s, spec) for s in shards):
        return [run_shard(root, source, STAGE, s, _never) for s in shards]
    stream = encode_stream(
        root,
        source,
        shards,
        model,
        batch_size=batch_size,
        device=device,
        num_workers=num_workers,
        compile=compile,
        spec=spec,
    )
    done = []
    with contextlib.closing(stream):
        for _, outcome in stream:
            if isinstance(outcome, Exception):
                raise outcome
            done.append(outcome)
    return done


def _never(stats: ShardStats) -> None:
    raise AssertionError(f"{stats.shard} was done")


def encode_shard(
    root: Path, source: str, shard: str, model: Model, *, batch_size: int = 32, **kwargs
) -> ShardStats:
    """Encode one shard (see `encode_shards` for the keyword arguments)."""
    return encode_shards(root, source, [shard], model, batch_size=batch_size, **kwargs)[0]


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
        _shutdown_pools()


def encode_on_devices(
    root: Path,
    source: str,
    shards: Sequence[str],
    model: Model,
    devices: Sequence[str],
    *,
    batch_size: int = 32,
    num_workers: int | None = None,
    compile: bool = False,
    spec: LatentSpec | None = None,
) -> list[ShardStats]:
    """One encoder process per device (e.g. every GPU of a machine), each on its share."""
    cores = max(1, len(os.sched_getaffinity(0)) // len(devices))
    options = dict(
        batch_size=batch_size,
        num_workers=num_workers or max(1, cores - 1),
        compile=compile,
        spec=spec,
    )
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
