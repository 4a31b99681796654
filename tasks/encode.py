"""encode: a shard's images -> VAE posterior mean x scaling factor -> fp16 `latents/NNNNN.npy`.

Row i of the latents is row i of `NNNNN.keys.arrow` (its key, token row: tasks/latent_keys). Stages
overlap so the VAE never waits for data: I/O thread -> feeder thread -> decode processes ->
pinned ring -> side-stream copy -> VAE. Batches never span shards and always have `batch_size`
rows (holes zeroed), so a shard's latents are the same bits whatever was encoded before it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
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
import pyarrow.parquet as pq
import torch

from catalog import Model
from sdtrain.lazy import BUILD_LOCK
from sdtrain.models import build_vae
from tasks import images, latent_keys
from tasks.shards import (
    ShardStats,
    atomic_path,
    is_done,
    read_stats,
    run_shard,
    write_json_atomic,
)

STAGE = "latents"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
DECODE_AHEAD = 128  # images handed to the decoders before the VAE asks for them
DRAIN_AFTER_S = 0.1  # no batch came this long: finish those in flight (see _Pipeline.results)
QA_FILE = "qa.json"

_vaes: dict[tuple[str, str], torch.nn.Module] = {}
_encoders: dict[tuple[str, str, bool], Callable[[torch.Tensor], torch.Tensor]] = {}
_pools: dict[int, images.DecodePool] = {}
_lanes: dict[int, ThreadPoolExecutor] = {}
_lock = BUILD_LOCK  # shared with every lazy builder: see sdtrain/lazy.py


class EncodeFailed(Exception):
    """An encoder process (one per device) failed; its shards are left undone."""


def load_image(data: bytes, size: int) -> np.ndarray | None:
    """RGB uint8 [size, size, 3] by the rules of tasks/images.py; None if they drop it."""
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


def encoder_for(model: Model, device: torch.device, compile: bool = False):
    """The process's `latent_encoder` of `vae_for(model, device)`, compiled once if asked."""
    device = _canonical(device)
    vae = vae_for(model, device)
    with _lock:
        key = (model.name, str(device), compile)
        if key not in _encoders:
            if device.type == "cuda":
                # Every batch has the same shape: let cuDNN time its algorithms once.
                torch.backends.cudnn.benchmark = True
            _encoders[key] = latent_encoder(vae, model.scaling_factor, compile=compile)
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


@dataclass(slots=True)
class _ShardInput:
    shard: str
    token_keys: list[str]
    tar_bytes: bytes
    error: Exception | None = None  # its inputs could not be read: this shard fails, alone
    skip: bool = False  # done already


@dataclass(slots=True)
class _ShardJob:
    """A shard's images found in its tar, in token order; its batches follow it."""

    shard: str
    num_in: int
    keys: list[str]
    token_rows: list[int]
    num_batches: int
    error: Exception | None = None
    skip: bool = False
    started: float = 0.0  # when its images began to be handed out (its record's seconds)


@dataclass(slots=True)
class _Batch:
    job: _ShardJob
    start: int  # index of its first image in job.keys
    size: int
    futures: list[Future]


@dataclass(slots=True)
class _Encoded:
    job: _ShardJob
    latents: np.ndarray  # fp16 [len(job.keys), 4, h, w]; rows of dropped images are junk
    dropped: dict[int, str] = field(default_factory=dict)  # index in job.keys -> reason
    num_batches_done: int = 0
    data_wait_s: float = 0.0

    @property
    def complete(self) -> bool:
        return self.num_batches_done == self.job.num_batches


class _Ring:
    """Host batches the decoders' pixels are gathered in, and their encode.

    On a GPU they are pinned and each is copied on a side stream, overlapping the encode of the
    batch before it; a slot is refilled once its copy has finished. On CPU `lanes` batches are
    encoded at once, one per core (`cpu_lanes`).
    """

    def __init__(self, encode, device: torch.device, batch_size: int, side: int):
        self.encode_fn, self.device = encode, device
        cuda = device.type == "cuda"
        num_lanes = torch.get_num_threads()
        self.lanes = None if cuda else cpu_lanes(num_lanes)
        self.depth = 1 if cuda else num_lanes  # batches encoding at once
        num_slots = self.depth + 2  # + one filling + one spare
        self.host = [
            torch.empty((batch_size, side, side, 3), dtype=torch.uint8, pin_memory=cuda)
            for _ in range(num_slots)
        ]
        self.out = [
            torch.empty((batch_size, 4, side // 8, side // 8), dtype=torch.float16, pin_memory=True)
            for _ in range(num_slots if cuda else 0)
        ]
        self.copied: list[torch.cuda.Event | None] = [None] * num_slots
        self.copy_stream = torch.cuda.Stream(device) if cuda else None

    def __len__(self) -> int:
        return len(self.host)

    def slot(self, i: int) -> np.ndarray:
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        return self.host[i].numpy()

    def submit(self, i: int):
        """Start encoding slot i; returns what `result` needs."""
        if self.lanes is not None:
            return self.lanes.submit(_inference(self.encode_fn), self.host[i])
        with torch.cuda.device(self.device), torch.inference_mode():
            compute = torch.cuda.current_stream()
            with torch.cuda.stream(self.copy_stream):
                x = self.host[i].to(self.device, non_blocking=True)
            self.copied[i] = self.copy_stream.record_event()
            compute.wait_event(self.copied[i])
            x.record_stream(compute)  # x was allocated on the copy stream, used on this one
            self.out[i].copy_(self.encode_fn(x), non_blocking=True)
            return i, compute.record_event()

    def result(self, handle) -> np.ndarray:
        if self.lanes is not None:
            return handle.result().numpy()
        i, done = handle
        done.synchronize()
        return self.out[i].numpy()


class _Pipeline:
    """The encode of shards as they come: `results()` yields each shard's latents, in order.

    `shards` may be an iterator that blocks until the next shard is given (a device worker of
    build-latents, flows/devices.py): the I/O thread waits on it while the VAE works.
    """

    def __init__(self, root, source, shards, model, *, batch_size, device, num_workers, compile):
        self.root, self.source, self.shards, self.model = root, source, shards, model
        self.batch_size, self.size = batch_size, model.resolution
        self.pool = _decode_pool(num_workers)
        self.chunk = math.ceil(batch_size / num_workers)  # images per decode task
        self.ring = _Ring(encoder_for(model, device, compile), device, batch_size, self.size)
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
                if is_done(self.root, self.source, STAGE, shard):
                    self.inputs.put(_ShardInput(shard, [], b"", skip=True))
                    continue
                try:
                    tokens = self.root / self.source / "tokens" / f"{shard}.parquet"
                    keys = pq.read_table(tokens, columns=["key"])["key"].to_pylist()
                    tar = self.root / self.source / "shards" / f"{shard}.tar"
                    item = _ShardInput(shard, keys, tar.read_bytes())
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
            num_batches=math.ceil(len(present) / self.batch_size),
            started=started,
        )
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
            if isinstance(item, _ShardJob):
                side = self.size // 8
                latents = np.empty((len(item.keys), 4, side, side), np.float16)
                order.append(_Encoded(item, latents))
                yield from self._pop_complete(order)
                continue
            encoded = order[-1]
            slot = num_submitted % len(self.ring)
            host = self.ring.slot(slot)
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

    def _collect(self, batch: _Batch, encoded: _Encoded, handle) -> None:
        latents = self.ring.result(handle)
        encoded.latents[batch.start : batch.start + batch.size] = latents[: batch.size]
        encoded.num_batches_done += 1

    @staticmethod
    def _pop_complete(order: deque[_Encoded]) -> Iterator[_Encoded]:
        while order and order[0].complete:
            yield order.popleft()


def _commit(root: Path, source: str, model: Model, encoded: _Encoded, stats: ShardStats):
    job = encoded.job
    if job.shard != stats.shard:  # the pipeline yields shards in the order it was given them
        raise RuntimeError(f"encode: got shard {job.shard} for {stats.shard}")
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
    stats.extra = {
        "model": model.name,
        "latent_mean": float(as32.mean()) if kept else None,
        "latent_std": float(as32.std()) if kept else None,
        "data_wait_seconds": round(encoded.data_wait_s, 3),
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
) -> Iterator[tuple[str, ShardStats | Exception]]:
    """Encode shards as they come through one pipeline, the next one's inputs read while one
    encodes: (shard, its stats record, or the error that failed it) in the order given.

    `shards` may block for the next shard (one long-lived encoder per device: a device worker
    of build-latents, flows/devices.py). A shard whose inputs cannot be read or whose outputs
    cannot be written fails alone (its failure record written); shards done already are
    skipped. The record's `extra["device"]` names the device.
    """
    device = _canonical(torch.device(device) if device is not None else default_device())
    pipeline = _Pipeline(
        root,
        source,
        shards,
        model,
        batch_size=batch_size,
        device=device,
        num_workers=num_workers or default_num_workers(device),
        compile=compile,
    )
    with pipeline:
        for encoded in pipeline.results():
            shard = encoded.job.shard
            finish = functools.partial(_finish, root, source, model, device, encoded)
            try:
                stats = run_shard(root, source, STAGE, shard, finish, started=encoded.job.started)
            except Exception as e:
                yield shard, e
            else:
                yield shard, stats


def _finish(root, source, model, device, encoded: _Encoded, stats: ShardStats) -> None:
    if encoded.job.error is not None:
        raise encoded.job.error
    if encoded.job.skip:  # its record was there when its inputs were read
        raise RuntimeError(f"encode: {stats.shard}'s record vanished while encoding")
    _commit(root, source, model, encoded, stats)
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
) -> list[ShardStats]:
    """Encode `shards` in order through one pipeline; shards already done are skipped. The
    first shard that fails raises (the shards before it are done)."""
    if all(is_done(root, source, STAGE, s) for s in shards):
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
) -> list[ShardStats]:
    """One encoder process per device (e.g. every GPU of a machine), each on its share."""
    cores = max(1, len(os.sched_getaffinity(0)) // len(devices))
    options = dict(
        batch_size=batch_size, num_workers=num_workers or max(1, cores - 1), compile=compile
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
    samples = []
    for shard in sorted({c[0] for c in chosen}):
        picked = [c for c in chosen if c[0] == shard]
        data = read_images(root / source / "shards" / f"{shard}.tar", {k for _, _, k in picked})
        latents = np.load(root / source / STAGE / f"{shard}.npy", mmap_mode="r")
        z = torch.from_numpy(np.stack([latents[i] for _, i, _ in picked]).astype(np.float32))
        x = torch.from_numpy(
            np.stack([images.decode_image(data[k], model.resolution) for *_, k in picked])
        )
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            decoded = vae.decode(z.to(device) / model.scaling_factor).sample
        decoded = decoded.float().clamp(-1, 1).add(1).mul(127.5).cpu()
        mse = (decoded - x.permute(0, 3, 1, 2).float()).pow(2).mean(dim=(1, 2, 3))
        for (_, _, key), err in zip(picked, mse.tolist(), strict=True):
            samples.append({"shard": shard, "key": key, "psnr_db": 10 * math.log10(255**2 / err)})
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
