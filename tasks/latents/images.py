"""Image bytes -> RGB uint8 pixels by one stated rule per kind of input; decode workers.

Two transforms share the rules: `repack_image` (the shards: the image resized down so its
short side is at most `size` and its long side at most 4 x `size`, aspect ratio kept, never
up) and `decode_image` (a reader's `size` x `size` square: short side resized to `size`,
center crop).

A JPEG with room for it is decoded reduced by 2, 4 or 8 in the DCT domain (libjpeg scaling,
the same pixels as PIL's `draft`) before the resize: the reduced image still has at least the
target's sides, so the reduced decode is part of the transform, not an approximation of it.
Workers are plain `python -m tasks.latents.images` processes, so this module imports neither torch
nor sdpipe. What the bytes say before decoding (format, truncation, header size) is in
image_headers.py.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import traceback
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path

import cv2
import numpy as np

from catalog import buckets
from tasks.latents.image_headers import header_size, is_truncated, jpeg_size, sniff
from tasks.runtime.lanes import Lanes
from tasks.runtime.net import python_path
from tasks.runtime.node import Node, Slots, local_node

# The rules, in the order they are applied (a reason is what the stats record counts):
# - bytes no decoder reads -> dropped, `decode_error`
# - JPEG with no end marker after its last scan, PNG with no IEND chunk, WebP shorter than its
#   RIFF header says -> dropped, `truncated`
# - JPEG: EXIF orientation applied; grayscale and CMYK/YCCK converted to RGB by libjpeg/OpenCV
#   (on the stored, Adobe-inverted samples C', K': R = K' - ((255 - C') K' >> 8), i.e.
#   (255 - C)(255 - K) / 255 to within a level)
# - other formats (PNG, WebP, GIF, BMP, TIFF) as stored (no EXIF orientation); palette
#   expanded; 16-bit samples keep their high byte; alpha composited over white (as img2dataset
#   does for URL sources); samples that are not 8/16-bit integers -> dropped, `unsupported_depth`
# - more than MAX_PIXELS pixels by the header (a decompression bomb, or nothing a 512 px
#   sample needs) -> dropped, `too_large`, before any pixel is decoded
# - aspect ratio above MAX_ASPECT (a sliver; a reader's square would be a speck of it, its
#   resized long side huge) -> dropped, `extreme_aspect`
# - an image whose decode kills the worker process -> dropped, `decoder_crash` (DecodePool)
# - then, in the shards (`repack_image`): the crop box if the source gives one (a crop of the
#   image as displayed, before any resize), then resized down (INTER_AREA) to a short side of
#   at most `size`, long side at most 4 x `size`, aspect kept (`buckets.stored_size`), never up;
#   for a reader (`decode_image`, `fit`): short side resized to `size` (INTER_AREA down,
#   INTER_CUBIC up), then the center `size` x `size` crop.
MAX_ASPECT = 64
MAX_PIXELS = 2 * 89_478_485  # PIL's decompression-bomb error limit
# What a crop box that leaves the image is padded with: mid-gray, 0 in the VAE's [-1, 1] input.
PAD_FILL = 127
REDUCED_FLAGS = {
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}


class Unusable(Exception):
    """An image this stage drops; `reason` is what the shard's stats count it under."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def reduction(short_side: int, size: int) -> int:
    """The DCT reduction of a JPEG: the largest of 8, 4, 2 that keeps the short side >= size."""
    return next((k for k in (8, 4, 2) if short_side >= k * size), 1)


def stored_reduction(region: tuple[int, int], target: tuple[int, int]) -> int:
    """The DCT reduction for a stored image: the largest of 8, 4, 2 that keeps the kept region
    (width, height, in full-size pixels) at least `target` (its stored sides) on both sides."""
    return next(
        (k for k in (8, 4, 2) if region[0] >= k * target[0] and region[1] >= k * target[1]), 1
    )


def decode_rgb(data: bytes, size: int, *, reduce: int | None = None) -> np.ndarray:
    """Decoded RGB uint8 [h, w, 3] by the rules above (not yet resized); raises Unusable.

    A JPEG is decoded reduced by `reduce` if given, else by the short-side rule (`reduction`)
    that `fit` to `size` needs."""
    fmt = sniff(data)
    if is_truncated(data, fmt):
        raise Unusable("truncated")
    dims = header_size(data, fmt)
    if dims and dims[0] * dims[1] > MAX_PIXELS:
        raise Unusable("too_large")
    buf = np.frombuffer(data, np.uint8)
    if fmt == "jpeg":
        k = reduce if reduce is not None else reduction(min(dims), size) if dims else 1
        bgr = cv2.imdecode(buf, REDUCED_FLAGS[k] if k > 1 else cv2.IMREAD_COLOR)
        if bgr is None:
            raise Unusable("decode_error")
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    img = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
    if img is None:
        raise Unusable("decode_error")
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise Unusable("unsupported_depth")
    if img.ndim == 2 or img.shape[2] == 1:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    if img.shape[2] == 4:
        alpha = img[:, :, 3:].astype(np.uint32)
        over_white = (img[:, :, :3] * alpha + 255 * (255 - alpha) + 127) // 255
        return cv2.cvtColor(over_white.astype(np.uint8), cv2.COLOR_BGR2RGB)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def fit(rgb: np.ndarray, size: int) -> np.ndarray:
    """Short side resized to `size`, then the center `size` x `size` crop."""
    return cover(rgb, (size, size))


def cover(rgb: np.ndarray, bucket: tuple[int, int]) -> np.ndarray:
    """`rgb` resized to cover `bucket` (width, height) and center-cropped to it
    (`buckets.cover_box`): INTER_AREA down, INTER_CUBIC up."""
    check_aspect(rgb)
    h, w = rgb.shape[:2]
    bw, bh = bucket
    new_w, new_h, left, top = buckets.cover_box(w, h, bucket)
    if (new_w, new_h) != (w, h):
        interpolation = cv2.INTER_AREA if new_w * new_h < w * h else cv2.INTER_CUBIC
        rgb = cv2.resize(rgb, (new_w, new_h), interpolation=interpolation)
    return np.ascontiguousarray(rgb[top : top + bh, left : left + bw])


def check_aspect(rgb: np.ndarray) -> None:
    """A sliver past MAX_ASPECT is dropped (`extreme_aspect`)."""
    h, w = rgb.shape[:2]
    if max(h, w) > MAX_ASPECT * min(h, w):
        raise Unusable("extreme_aspect")


def decode_image(data: bytes, size: int) -> np.ndarray:
    """RGB uint8 [size, size, 3] of an image's bytes; raises Unusable with the drop reason."""
    try:
        return fit(decode_rgb(data, size), size)
    except cv2.error:
        raise Unusable("decode_error") from None


def decode_rows(
    items: list[tuple[int, bytes]], size: int
) -> tuple[list[int], np.ndarray, dict[int, str]]:
    """Decode worker task: (rows decoded, their pixels [n, size, size, 3], reason per dropped row).

    Whatever one image raises drops that image only: the shard goes on.
    """
    rows, pixels, dropped = per_image(items, lambda data: decode_image(data, size))
    stacked = np.stack(pixels) if pixels else np.zeros((0, size, size, 3), np.uint8)
    return rows, stacked, dropped


def original_size(data: bytes, decoded: np.ndarray, reduced: int) -> tuple[int, int]:
    """(width, height) of the image as stored, EXIF orientation applied."""
    h, w = decoded.shape[:2]
    dims = jpeg_size(data) if reduced > 1 else None
    if dims is None:
        return w, h
    # The frame header gives the stored size; orientation may have turned it by 90 degrees.
    return dims if (dims[0] >= dims[1]) == (w >= h) else (dims[1], dims[0])


def crop_padded(
    rgb: np.ndarray, crop: tuple[int, int, int, int], width: int, height: int
) -> np.ndarray:
    """The box `crop` (x, y, w, h in stored pixels of a `width` x `height` image) of `rgb` (the
    image as decoded, maybe reduced), padded with PAD_FILL where it leaves the image."""
    sx, sy = rgb.shape[1] / width, rgb.shape[0] / height
    x0, y0 = round(crop[0] * sx), round(crop[1] * sy)
    x1, y1 = round((crop[0] + crop[2]) * sx), round((crop[1] + crop[3]) * sy)
    ix0, iy0 = max(0, x0), max(0, y0)
    ix1, iy1 = min(rgb.shape[1], x1), min(rgb.shape[0], y1)
    if ix1 - ix0 < 1 or iy1 - iy0 < 1:
        raise Unusable("empty_crop")
    if (ix0, iy0, ix1, iy1) == (x0, y0, x1, y1):
        return rgb[y0:y1, x0:x1]
    canvas = np.full((y1 - y0, x1 - x0, 3), PAD_FILL, np.uint8)
    canvas[iy0 - y0 : iy1 - y0, ix0 - x0 : ix1 - x0] = rgb[iy0:iy1, ix0:ix1]
    return canvas


def repack_image(
    data: bytes,
    size: int,
    *,
    min_side: int = 0,
    crop: tuple[int, int, int, int] | None = None,
    quality: int = 95,
) -> tuple[bytes, int, int]:
    """(JPEG bytes of the stored image, original width, original height) of an image's bytes.

    The decode rules above, then `crop` (x, y, w, h in stored pixels; where the box leaves the
    image it is padded with PAD_FILL) if given, then resized down to a short side of at most
    `size`, aspect ratio kept (`buckets.stored_size` of the kept region; never up). Raises Unusable:
    the rules' reasons, or `too_small` when the original short side is under `min_side`.
    """
    fmt = sniff(data)
    dims = jpeg_size(data) if fmt == "jpeg" else None
    if dims and min(dims) < min_side:
        raise Unusable("too_small")
    k = 1
    if dims:
        # The reduced decode must keep the kept region at least its stored sides. EXIF
        # orientation may swap the header's sides; a reduction scales both alike, so the rule
        # holds either way (and a crop box is the region whatever the orientation).
        region = (crop[2], crop[3]) if crop else dims
        if min(region) > 0:
            k = stored_reduction(region, buckets.stored_size(*region, size))
    try:
        rgb = decode_rgb(data, size, reduce=k)
        width, height = original_size(data, rgb, k)
        if min(width, height) < min_side:
            raise Unusable("too_small")
        if crop:
            rgb = crop_padded(rgb, crop, width, height)
            region = (crop[2], crop[3])
        else:
            region = (width, height)
        stored = shrink(rgb, buckets.stored_size(*region, size))
        ok, jpeg = cv2.imencode(
            ".jpg", cv2.cvtColor(stored, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality]
        )
    except cv2.error:
        raise Unusable("decode_error") from None
    if not ok:
        raise Unusable("encode_error")
    return jpeg.tobytes(), width, height


def shrink(rgb: np.ndarray, target: tuple[int, int]) -> np.ndarray:
    """`rgb` resized to `target` (width, height), the stored size of the full-size region it
    shows (maybe decoded reduced): INTER_AREA, as a reduced decode keeps at least the target's
    sides (INTER_CUBIC only where a crop box's rounding left a side a pixel short)."""
    check_aspect(rgb)
    h, w = rgb.shape[:2]
    if (w, h) == target:
        return np.ascontiguousarray(rgb)
    down = w >= target[0] and h >= target[1]
    interpolation = cv2.INTER_AREA if down else cv2.INTER_CUBIC
    return cv2.resize(rgb, target, interpolation=interpolation)


def repack_rows(
    items: list[tuple[int, bytes, tuple | None]], size: int, *, min_side: int = 0
) -> tuple[list[int], list[tuple[bytes, int, int]], dict[int, str]]:
    """Repack worker task: (rows repacked, their (jpeg, width, height), reason per dropped row)."""
    return per_image(
        items, lambda data, crop: repack_image(data, size, min_side=min_side, crop=crop)
    )


def per_image(items: Iterable[tuple], transform) -> tuple[list[int], list, dict[int, str]]:
    """A worker task's loop over (row, *arguments) items: (rows done, `transform(*arguments)` of
    each, reason per dropped row). Whatever one image raises drops that image only: a decoder's
    unforeseen failure is one bad image (`decode_error`), not a bad shard."""
    rows, out, dropped = [], [], {}
    for row, *arguments in items:
        try:
            out.append(transform(*arguments))
            rows.append(row)
        except Unusable as e:
            dropped[row] = e.reason
        except Exception:
            dropped[row] = "decode_error"
    return rows, out, dropped


# ---- decode workers --------------------------------------------------------------------------

# What a worker can be asked to do: name -> fn(items, size, **options) -> (rows, payload,
# dropped), where payload is an array (stacked pixels) or a list, one entry per row kept.
WORKER_TASKS = {"decode": decode_rows, "repack": repack_rows}

WORKER_COMMAND = (sys.executable, "-m", "tasks.latents.images")


def serve() -> None:
    """A worker's loop: length-prefixed pickled (task, items, size, options) on stdin, pickled
    results on stdout. A task's own exception (not one image's: those are drop reasons) is sent
    back as `{"worker_error": message}`, and fails its request, not the worker: retrying it
    image by image on new workers would only repeat it (a path it cannot open, a step it
    cannot load). The length prefix keeps the stream whole when a request cannot be read."""
    # Parallelism comes from the worker processes; cv2's own threads would oversubscribe.
    cv2.setNumThreads(1)
    # The protocol gets a private copy of stdout; fd 1 goes to stderr, so whatever a C
    # library prints cannot corrupt it.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    while True:
        head = requests.read(8)
        if len(head) < 8:  # the parent closed our stdin, or died
            return
        payload = requests.read(int.from_bytes(head, "little"))
        try:
            task, items, size, options = pickle.loads(payload)
            result = WORKER_TASKS[task](items, size, **options)
        except Exception as e:
            tail = traceback.format_exc(limit=-3)
            result = {"worker_error": f"{type(e).__name__}: {e}\n{tail}"}
        pickle.dump(result, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


class WorkerDied(Exception):
    pass


class WorkerError(Exception):
    """A decode worker's task failed as a whole (not an image of it): the request fails."""


class _Worker:
    def __init__(self, command: tuple[str, ...]):
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": python_path()},
        )

    def call(self, request: tuple):
        """The request's result, or a WorkerError to fail it with; raises WorkerDied."""
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
            self.proc.stdin.flush()
            result = pickle.load(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            self.proc.kill()
            self.proc.wait()
            raise WorkerDied(f"decode worker exited with {self.proc.returncode}") from e
        if isinstance(result, dict) and "worker_error" in result:
            return WorkerError(f"decode worker, task {request[0]!r}: {result['worker_error']}")
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


class DecodePool(Lanes):
    """Decode worker processes fed over pipes, one feeding thread per worker.

    Not multiprocessing: a worker needs neither fork nor the parent's main module, and it
    exits when its stdin closes, so a killed parent leaves no orphans. A worker that dies in a
    task (a decoder crash) is replaced and the task's images retried one at a time: the image
    that kills a worker on its own is dropped as `decoder_crash`, the others are kept.
    """

    def __init__(
        self,
        num_workers: int,
        command: tuple[str, ...] = WORKER_COMMAND,
        *,
        eager: bool = False,
        slots: Slots | None = None,
        kind: str = "decode",
    ):
        """`eager`: start every worker process now, not at its first task. `slots`: the node's
        (tasks/runtime/node.py), which its live workers hold, one each, as a `kind` of pool."""
        self.command = command
        super().__init__(num_workers, kind, eager=eager, slots=slots)

    def submit(self, items: list, size: int, task: str = "decode", **options) -> Future:
        """A future of `WORKER_TASKS[task](items, size, **options)`, computed in a worker."""
        return self._submit((task, items, size, options))

    def _start(self) -> _Worker:
        return _Worker(self.command)

    def _run(self, worker, request) -> tuple:
        try:
            worker = worker or self._start()
            return worker.call(request), worker
        except WorkerDied:
            return self._one_at_a_time(*request)

    def _one_at_a_time(self, task, items, size, options) -> tuple:
        """The request's items each alone, on one worker replaced only when an item kills it
        (a worker can cost seconds of imports to start): (the result, the worker to keep)."""
        rows, parts, dropped = [], [], {}
        worker = None
        for item in items:
            try:
                worker = worker or self._start()
                result = worker.call((task, [item], size, options))
            except WorkerDied:
                dropped[item[0]] = "decoder_crash"
                worker = None
                continue
            if isinstance(result, WorkerError):  # the request's own failure: it fails
                return result, worker
            ok, payload, why = result
            rows += ok
            parts.append(payload)
            dropped |= why
        empty = WORKER_TASKS[task]([], size, **options)[1]
        if isinstance(empty, np.ndarray):
            return (rows, np.concatenate([empty, *parts]), dropped), worker
        return (rows, [x for part in parts for x in part], dropped), worker


def image_members(
    tar: tarfile.TarFile, keys: set[str], extensions: Iterable[str]
) -> dict[str, tarfile.TarInfo]:
    """key -> the member holding its image (`<key>.<ext>`, ext among `extensions`), for `keys`:
    the last one, as an extraction would keep. Headers only, no image bytes are read."""
    found = {}
    while (member := tar.next()) is not None:
        tar.members.clear()  # tarfile keeps every header it reads: it would grow with the shard
        key, _, ext = member.name.partition(".")
        if key in keys and ext.lower() in extensions and member.isfile():
            found[key] = member
    return found


def read_images(tar_path: Path, keys: set[str], extensions: Iterable[str]) -> dict[str, bytes]:
    """The image bytes of `keys` from a webdataset tar (only theirs are read)."""
    with tarfile.open(tar_path) as tar:
        members = image_members(tar, keys, extensions)
        return {k: tar.extractfile(m).read() for k, m in members.items()}


def write_sample(tar: tarfile.TarFile, key: str, jpeg: bytes, caption: str, meta: dict) -> None:
    """One webdataset sample: key.jpg, key.txt (the caption), key.json (its sample-table row)."""
    for ext, data in (
        ("jpg", jpeg),
        ("txt", caption.encode()),
        ("json", json.dumps(meta, ensure_ascii=False).encode()),
    ):
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def shared_pool(node: Node | None = None) -> DecodePool:
    """The node's repack decode pool (default: this process's node), up to its budget of
    workers, kept for every later shard of every stage that repacks (a pool per shard would
    start its processes each time)."""
    node = node or local_node()
    return node.pool(
        "repack", node.workers, lambda n, slots: DecodePool(n, slots=slots, kind="repack")
    )


def repack_stream(
    pool: DecodePool,
    items: Iterable[tuple[int, bytes, tuple | None]],
    size: int,
    *,
    min_side: int = 0,
    chunk: int = 32,
    in_flight: int = 4,
) -> Iterator[tuple[int, tuple[bytes, int, int] | str]]:
    """(row, (jpeg, width, height)) per image kept, (row, reason) per image dropped: `items`
    (row, bytes, crop box) through the pool's repack workers, streamed in chunks with at most
    `in_flight` chunks per worker waiting, so memory holds a few chunks, not a shard."""
    pending: collections.deque[Future] = collections.deque()
    limit = in_flight * len(pool.threads)

    def drain(until: int) -> Iterator:
        while len(pending) > until:
            done, payload, dropped = pending.popleft().result()
            yield from zip(done, payload, strict=True)
            yield from dropped.items()

    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == chunk:
            pending.append(pool.submit(batch, size, "repack", min_side=min_side))
            batch = []
            yield from drain(limit)
    if batch:
        pending.append(pool.submit(batch, size, "repack", min_side=min_side))
    yield from drain(0)


# ---- aspect-ratio buckets (encode) -------------------------------------------------------------

_plans: dict[str, tuple] = {}


def _plan(plan: dict) -> tuple:
    """(BucketPlan, its sizes) of a plan's dict, built once per worker."""
    key = json.dumps(plan, sort_keys=True)
    if key not in _plans:
        built = buckets.BucketPlan(**plan)
        _plans[key] = (built, built.sizes())
    return _plans[key]


def _cover_side(dims: tuple[int, int] | None, plan, sizes: np.ndarray) -> int:
    """The short side an image of header size `dims` is resized to when it covers its bucket
    (either orientation, as EXIF may turn it): a reduced JPEG decode keeps at least that."""
    if not dims or min(dims) < 1:
        return int(sizes.max())
    need = 1
    for w, h in (dims, dims[::-1]):
        bw, bh = sizes[int(plan.assign([w], [h])[0])].tolist()
        need = max(need, int(np.ceil(min(w, h) * max(bw / w, bh / h))))
    return need


def decode_to_bucket(data: bytes, plan: dict) -> tuple[int, np.ndarray]:
    """(bucket index into the plan's sizes, RGB uint8 [H, W, 3] of that bucket) of an image's
    bytes: the decode rules above, the bucket nearest the decoded image's aspect ratio, resized
    to cover it (INTER_AREA down, INTER_CUBIC up) and center-cropped (`buckets.cover_box`).
    Raises Unusable with the drop reason."""
    built, sizes = _plan(plan)
    try:
        fmt = sniff(data)
        rgb = decode_rgb(data, _cover_side(header_size(data, fmt), built, sizes))
        check_aspect(rgb)
        h, w = rgb.shape[:2]
        bucket = int(built.assign([w], [h])[0])
        return bucket, cover(rgb, tuple(sizes[bucket].tolist()))
    except cv2.error:
        raise Unusable("decode_error") from None


def decode_bucketed(
    items: list[tuple[int, bytes]], size: int, *, plan: dict
) -> tuple[list[int], list[tuple[int, np.ndarray]], dict[int, str]]:
    """Decode worker task of a bucket plan (`BucketPlan.to_dict()`): (rows decoded, their
    (bucket index, pixels [H, W, 3] of the bucket), reason per dropped row). `size` is unused
    (the plan sets the shapes); whatever one image raises drops that image only."""
    return per_image(items, lambda data: decode_to_bucket(data, plan))


WORKER_TASKS["bucketed"] = decode_bucketed


if __name__ == "__main__":
    serve()
