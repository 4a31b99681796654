"""The decode-and-batch pipeline of encode: I/O thread -> feeder thread -> decode processes ->
pinned ring -> side-stream copy -> VAE, so the VAE never waits for data.

A shard streams through it: the I/O thread reads its images from the tar a decode task's worth
at a time (encode_read.py), a bounded read-ahead ahead of the feeder, so the bytes held are
those of the batches in flight, never a shard's.

Batches always have `batch_size` rows (holes and padding zeroed) and never span buckets; legacy
batches never span shards, bucketed ones do (a bucket's unfinished batch waits for the next
shard's images for at most `flush_after` batches, then goes out padded: shards complete in order,
so a rare bucket would hold every later shard's record). The VAE works per image, so a
shard's latents are the same bits whatever was encoded before it. Decode pools and CPU lanes are
kept per size for every later shard (the node's decode pools, under its process slots)."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from sdtrain.lazy import BUILD_LOCK
from tasks.latents import images
from tasks.latents.encode_read import ShardInput, open_shard
from tasks.latents.encode_spec import LatentSpec, forget_other_spec
from tasks.runtime.node import Node

DECODE_AHEAD = 128  # images handed to the decoders before the VAE asks for them
DRAIN_AFTER_S = 0.1  # no batch came this long: finish those in flight (see Pipeline.results)


_lock = BUILD_LOCK  # shared with every lazy builder: see sdtrain/lazy.py
_lanes: dict[int, ThreadPoolExecutor] = {}


def decode_pool(node: Node, num_workers: int) -> images.DecodePool:
    """The node's encode decode processes, one pool per size, kept for every later shard."""
    return node.pool(
        "encode-decode",
        num_workers,
        lambda n, slots: images.DecodePool(n, slots=slots, kind="encode-decode"),
    )


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


def in_inference_mode(fn):
    """`fn` in inference mode, which is per thread: for the lanes."""

    def run(*args):
        with torch.inference_mode():
            return fn(*args)

    return run


_END = object()  # a producer thread is finished
_SHARD_END = object()  # the feeder settled a shard's count of batches


@dataclass(slots=True)
class _Images:
    """The I/O thread's next images of the open shard: its keys[start : start + len(data)]."""

    start: int
    data: list[bytes]


@dataclass(slots=True)
class _ShardEnd:
    """The open shard's images are all read, or reading them failed (`error`)."""

    error: Exception | None = None


@dataclass(slots=True)
class _ShardJob:
    """A shard's images found in its tar, in token order; its batches follow it."""

    shard: str
    num_in: int
    keys: list[str]
    token_rows: list[int]
    num_batches: int  # -1 until the feeder has handed out its last batch
    error: Exception | None = None
    skip: bool = False
    started: float = 0.0  # when its images began to be handed out (its record's seconds)
    sha256: list[str] | None = None  # per key (bucketed layout)
    dropped: dict[int, str] = field(default_factory=dict)  # bucketed: filled by the feeder
    # Kept by the feeder: batches holding its images so far, its images waiting in a bucket's
    # unfinished batch (bucketed), and whether all its images are decoded (or handed out).
    handed: int = 0
    waiting: int = 0
    decoded: bool = False
    encoded: Encoded | None = None  # its latents, once the VAE's thread has seen it


@dataclass(slots=True)
class _Batch:
    job: _ShardJob
    start: int  # index of its first image in job.keys (legacy)
    size: int
    futures: list[Future]
    # The bucketed layout: its bucket (index into the plan's sizes), its images' pixels
    # [H, W, 3] of that bucket, decoded already, and whose they are: (shard job, the images'
    # indices in job.keys) per shard, in batch order. A batch may span shards, never buckets.
    bucket: int = -1
    pixels: list[np.ndarray] | None = None
    segments: list[tuple[_ShardJob, np.ndarray]] | None = None


@dataclass(slots=True)
class Encoded:
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
            return self.lanes.submit(in_inference_mode(self.encode_fn), self.views[i])
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


class Pipeline:
    """The encode of shards as they come: `results()` yields each shard's latents, in order.

    `shards` may be an iterator that blocks until the next shard is given (a device worker of
    build-latents, flows/execution/devices.py): the I/O thread waits on it while the VAE works.
    """

    def __init__(
        self,
        root,
        source,
        shards,
        model,
        *,
        batch_size,
        device,
        num_workers,
        spec,
        make_encoder,
        flush_after: int,
        node: Node,
    ):
        self.root, self.source, self.shards, self.model = root, source, shards, model
        self.spec: LatentSpec = spec
        self.bucketed = not spec.legacy
        self.batch_size, self.size = batch_size, model.resolution
        self.sizes = spec.plan.sizes()  # [K, 2] (width, height)
        self.plan = spec.plan.to_dict()
        self.pool = decode_pool(node, num_workers)
        self.num_workers = num_workers
        self.chunk = math.ceil(batch_size / num_workers)  # images per decode task
        if self.bucketed:
            max_pixels = int((self.sizes[:, 0] * self.sizes[:, 1]).max())
            out_per_pixel = spec.views * spec.channels / 64
        else:
            max_pixels, out_per_pixel = self.size * self.size, 4 / 64
        self.ring = _Ring(
            make_encoder(),
            device,
            batch_size,
            max_pixels,
            out_per_pixel,
        )
        # The read-ahead: a batch's images (in decode tasks' pieces) beyond those the feeder
        # has handed to the decoders; shard headers and ends ride along.
        self.inputs: queue.Queue = queue.Queue(maxsize=2 + math.ceil(batch_size / self.chunk))
        ahead = max(2, DECODE_AHEAD // batch_size)  # batches; shard headers ride along
        self.batches: queue.Queue = queue.Queue(maxsize=ahead)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.ended = False
        # Bucketed: per bucket, the decoded images of its unfinished batch, (job, index in
        # job.keys, pixels), across shards, and the count of batches handed out when its oldest
        # image came (the feeder's alone).
        self.waiting: dict[int, list[tuple[_ShardJob, int, np.ndarray]]] = {}
        self.waiting_since: dict[int, int] = {}
        self.num_handed = 0
        self.flush_after = flush_after  # batches (`encode.flush_after_setting`)
        # The feeder's open shard: its job, the decode tasks of its unfinished batch (legacy)
        # or those in flight (bucketed).
        self.job: _ShardJob | None = None
        self.decoding: deque[Future] = deque()
        self.threads = [
            threading.Thread(target=self._prefetch, name="encode-prefetch", daemon=True),
            threading.Thread(target=self._feed, name="encode-feed", daemon=True),
        ]

    def __enter__(self) -> Pipeline:
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
        """I/O thread: each shard's header, then its images a decode task's worth at a time."""
        try:
            for shard in self.shards:
                if self.stop.is_set():
                    break
                if forget_other_spec(self.root, self.source, shard, self.spec):
                    self.inputs.put(ShardInput(shard, skip=True))
                    continue
                self._read(shard)
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.inputs.put(_END)

    def _read(self, shard: str) -> None:
        header = None
        try:
            with open_shard(self.root, self.source, shard, digests=self.bucketed) as opened:
                header, images = opened
                self.inputs.put(header)
                start = 0
                for data in images(self._pieces(len(header.keys))):
                    if self.stop.is_set():
                        break
                    self.inputs.put(_Images(start, data))
                    start += len(data)
        except Exception as e:  # this shard's inputs (a tar cut short...): its failure alone
            self.inputs.put(ShardInput(shard, error=e) if header is None else _ShardEnd(e))
        else:
            self.inputs.put(_ShardEnd())

    def _pieces(self, num_images: int) -> Iterator[tuple[int, int]]:
        """(start, stop) of each decode task's images: up to `chunk` of them, never across
        batches in the legacy layout (a legacy batch is `batch_size` images in shard order)."""
        span = self.batch_size if not self.bucketed else max(1, num_images)
        for batch_start in range(0, num_images, span):
            batch_stop = min(num_images, batch_start + span)
            for start in range(batch_start, batch_stop, self.chunk):
                yield start, min(batch_stop, start + self.chunk)

    def _feed(self) -> None:
        """Feeder thread: hand a shard's images to the decoders as they are read, and their
        batches to the VAE's thread.

        Bucketed, a bucket's unfinished batch waits for the next shard's images of that bucket,
        so only the stream's last batch of a bucket is padded; when no shard comes within
        DRAIN_AFTER_S (the stream's end, or a stream fed as shards are made) they are handed
        out as they are, and the shards waiting on them complete."""
        try:
            while True:
                try:  # between shards: wait so long for the next, then flush
                    item = self.inputs.get(timeout=None if self.job else DRAIN_AFTER_S)
                except queue.Empty:
                    self._flush()
                    item = self.inputs.get()
                if item is _END:
                    break
                if self.stop.is_set():
                    self._abandon()
                elif isinstance(item, ShardInput):
                    self._open(item)
                elif isinstance(item, _Images):
                    self._decode(item)
                else:
                    self._close(item)
            if not self.stop.is_set():
                self._flush()
        except BaseException as e:
            self.errors.append(e)
            while self.inputs.get() is not _END:
                pass
        finally:
            self.batches.put(_END)

    def _open(self, item: ShardInput) -> None:
        started = time.perf_counter()
        if item.error is not None or item.skip:
            job = _ShardJob(item.shard, 0, [], [], 0, item.error, item.skip, started)
            self.batches.put(job)
            return
        self.job = _ShardJob(
            shard=item.shard,
            num_in=item.num_in,
            keys=item.keys,
            token_rows=item.token_rows,
            num_batches=-1,
            started=started,
            sha256=item.sha256,
        )
        self.batches.put(self.job)

    def _decode(self, item: _Images) -> None:
        """Legacy: a decode task of the open batch, handed out with its last one. Bucketed:
        decoded into their buckets (in the decode workers), gathered per bucket in stream order
        and handed out a full batch at a time (`_flush` hands out the unfinished ones); a
        bounded number of decode tasks is in flight, and at most a batch less one image waits
        per bucket."""
        job, stop = self.job, item.start + len(item.data)
        rows = range(item.start, stop)
        if self.bucketed:
            items = list(zip(rows, item.data, strict=True))
            self.decoding.append(self.pool.submit(items, self.size, "bucketed", plan=self.plan))
            while len(self.decoding) > max(2 * self.num_workers, DECODE_AHEAD // self.chunk):
                self._take_oldest()
            return
        batch_start = item.start - item.start % self.batch_size
        items = [(row - batch_start, data) for row, data in zip(rows, item.data, strict=True)]
        self.decoding.append(self.pool.submit(items, self.size))
        if stop % self.batch_size == 0 or stop == len(job.keys):
            futures = list(self.decoding)
            self.decoding.clear()
            job.handed += 1
            self.batches.put(_Batch(job, batch_start, stop - batch_start, futures))

    def _take_oldest(self) -> None:
        """The oldest bucketed decode task's images into their buckets' unfinished batches."""
        job = self.job
        rows, payload, dropped = self.decoding.popleft().result()
        job.dropped.update(dropped)
        for row, (bucket, pixels) in zip(rows, payload, strict=True):
            self.waiting.setdefault(bucket, []).append((job, row, pixels))
            self.waiting_since.setdefault(bucket, self.num_handed)
            job.waiting += 1
            if len(self.waiting[bucket]) == self.batch_size:
                self._hand_out(bucket)
        # A bucket that waited `flush_after` batches goes out as it is: its shards' records
        # (and every later shard's) would otherwise wait on images that may never come.
        stale = self.num_handed - self.flush_after
        for bucket in [b for b, since in self.waiting_since.items() if since <= stale]:
            self._hand_out(bucket)

    def _close(self, end: _ShardEnd) -> None:
        """The open shard's images are all handed to the decoders: once the last of them is
        handed out, its count of batches is final."""
        job = self.job
        if end.error is not None:
            job.error = end.error
            self._abandon()
        while self.decoding:  # bucketed: its last decode tasks
            self._take_oldest()
        job.decoded = True
        self.job = None
        self._settle([job])

    def _abandon(self) -> None:
        """The open shard's decode tasks not handed out are not needed."""
        for future in self.decoding:
            future.cancel()
        self.decoding.clear()

    def _hand_out(self, bucket: int) -> None:
        """The bucket's waiting images as one batch (the feeder's thread)."""
        waiting = self.waiting.pop(bucket)
        del self.waiting_since[bucket]
        self.num_handed += 1
        segments: list[tuple[_ShardJob, np.ndarray]] = []
        for job, row, _ in waiting:
            if not segments or segments[-1][0] is not job:
                segments.append((job, []))
            segments[-1][1].append(row)
        segments = [(job, np.array(rows, np.int64)) for job, rows in segments]
        for job, rows in segments:
            job.handed += 1
            job.waiting -= len(rows)
        pixels = [p for _, _, p in waiting]
        self.batches.put(_Batch(segments[0][0], -1, len(waiting), [], bucket, pixels, segments))
        self._settle([job for job, _ in segments])

    def _flush(self) -> None:
        """Hand out every bucket's unfinished batch: nothing more comes for now."""
        for bucket in sorted(self.waiting):
            self._hand_out(bucket)

    def _settle(self, jobs: list[_ShardJob]) -> None:
        """A decoded job with no image waiting has all its batches handed out: its count is final
        (set after its last batch is queued; the marker tells the VAE's thread to look)."""
        settled = False
        for job in jobs:
            if job.decoded and job.waiting == 0 and job.num_batches < 0:
                job.num_batches = job.handed
                settled = True
        if settled:
            self.batches.put(_SHARD_END)

    def results(self) -> Iterator[Encoded]:
        """The calling thread's loop: fill a ring slot, start its encode, collect the one before."""
        order: deque[Encoded] = deque()  # shards begun, in order
        in_flight: deque[tuple[_Batch, Encoded, object]] = deque()
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
                item.encoded = Encoded(item, latents)
                order.append(item.encoded)
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

    def _fill(self, host: np.ndarray, batch: _Batch, encoded: Encoded) -> None:
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

    def _collect(self, batch: _Batch, encoded: Encoded, handle) -> None:
        latents = self.ring.result(handle)
        if not self.bucketed:
            encoded.latents[batch.start : batch.start + batch.size] = latents[: batch.size]
            encoded.num_batches_done += 1
            return
        start = 0
        for job, rows in batch.segments:
            part = (rows, latents[start : start + len(rows)].copy())  # the slot is reused
            job.encoded.parts.setdefault(batch.bucket, []).append(part)
            job.encoded.num_batches_done += 1
            start += len(rows)

    @staticmethod
    def _pop_complete(order: deque[Encoded]) -> Iterator[Encoded]:
        while order and order[0].complete:
            yield order.popleft()
