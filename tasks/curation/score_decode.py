"""score's CPU side in processes: decode, PIL resizes and pHash, written into shared slots.

An image's PIL work is ~7.6 ms of CPU (a 512 px JPEG: decode, bicubic resizes and crops,
pHash), ~2,100 images/s on 16 cores, yet 16 decode threads reached 529 images/s on an H200
host (docs/benchmarks.md, issue 28): PIL releases the GIL inside its C loops, not between its
steps. Here a chunk of images goes to a decode worker process (`images.DecodePool`, started
with this module as its program), which writes each image's uint8 network inputs straight into
the shard's slots and sends back only its pHash. The slots live in a memfd: the parent maps it
as its slot tensors and a worker opens it through `/proc/<parent>/fd/<n>` for the chunk, so
only image bytes and pHashes cross the pipes, and a killed run leaves nothing behind (the
memory goes with the last process that maps it; a /dev/shm file would stay).

The worker runs the scorer's own PIL steps (`score.pil_steps` of open_clip's transforms and the
watermark model's), pickled with each chunk, so its pixels are the thread path's bits. A
worker that dies in an image is replaced and the image dropped as `decoder_crash`
(`DecodePool`); an image no decoder reads, or whose steps fail, is `decode_error`, as in the
thread path. A chunk's own failure (the memory cannot be opened, the steps cannot be loaded)
fails its shard with the worker's error (`images.WorkerError`). This module imports neither
torch nor sdpipe's flows, but a worker loads what unpickling the steps needs (torch,
torchvision, open_clip): ~4.5 s to start and up to ~0.8 GB resident each (much of it shared
library pages), up to one per worker of the node's budget, each under a slot of the node's.
"""

from __future__ import annotations

import io
import mmap
import os
import sys
from math import prod

import numpy as np
import scipy.fft
from PIL import Image

from tasks.latents import images
from tasks.runtime.node import Node

COMMAND = (sys.executable, "-m", "tasks.curation.score_decode")
CHUNK = 8  # images per request: a pipe round trip per 8 x ~7.6 ms of work


def phash(img: Image.Image) -> int:
    """64-bit perceptual hash, bit for bit `imagehash.phash`: the 8x8 lowest DCT frequencies of
    the 32x32 grayscale image against their median, first coefficient as the highest bit."""
    pixels = np.asarray(img.convert("L").resize((32, 32), Image.Resampling.LANCZOS), np.float64)
    low = scipy.fft.dct(scipy.fft.dct(pixels, axis=0), axis=1)[:8, :8]
    bits = np.packbits((low > np.median(low)).reshape(-1))
    return int.from_bytes(bits.tobytes(), "big")


def open_rgb(data: bytes) -> Image.Image:
    """An image's bytes as an RGB PIL image (PIL's own errors, a bomb's included, raise)."""
    return Image.open(io.BytesIO(data)).convert("RGB")


class SharedSlots:
    """Anonymous shared memory holding arrays of `shapes` (uint8, one after another), mapped
    here; `path` opens it in another process of this user while this object is open."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        self.layout = []
        offset = 0
        for shape in shapes:
            self.layout.append((offset, tuple(shape)))
            offset += prod(shape)
        self.fd = os.memfd_create("sdpipe-score-slots", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(offset, 1))
        self.map = mmap.mmap(self.fd, max(offset, 1))
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        # Which memory it is: a worker checks it opened this one, not whatever took the fd's
        # number since (`prepare_rows`).
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)
        try:
            opened = os.stat(self.path)
        except OSError as e:
            opened = e
        if not isinstance(opened, os.stat_result) or (opened.st_dev, opened.st_ino) != (
            self.identity
        ):
            self.close()
            raise OSError(
                f"decode processes cannot open this process's shared memory at {self.path} "
                f"({opened if isinstance(opened, OSError) else 'another file is there'}: /proc "
                "of another PID namespace, or a process that is not dumpable); score with "
                "decode threads: SDPIPE_SCORE_DECODE=threads"
            )

    def arrays(self) -> list[np.ndarray]:
        """The arrays, views of the shared memory (they keep the mapping alive)."""
        return [_view(self.map, offset, shape) for offset, shape in self.layout]

    def close(self) -> None:
        """No new process can open it; the mapping lives on while an array views it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _view(buffer, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(buffer, np.uint8, prod(shape), offset).reshape(shape)


def prepare_rows(
    items: list[tuple[int, int, bytes]],
    size: int,
    *,
    steps: list,
    memory: str,
    identity: tuple[int, int],
    layout: list,
) -> tuple[list[int], list[int], dict[int, str]]:
    """Worker task: each (row, slot, image bytes) decoded to RGB, each of `steps` (PIL
    transforms) applied and its pixels written to the slot of the matching array of `layout`
    in the shared memory at `memory` (whose (st_dev, st_ino) must be `identity`): (rows done,
    their pHashes, reason per dropped row). `size` is unused (the steps set the shapes)."""
    if not items:
        return [], [], {}
    try:
        fd = os.open(memory, os.O_RDWR)
    except OSError as e:
        raise OSError(
            f"cannot open the shard's shared slots at {memory} ({e.strerror}); score with "
            "decode threads: SDPIPE_SCORE_DECODE=threads"
        ) from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(identity):  # the shard's slots closed: not ours
            raise OSError(f"{memory} is no longer the shard's shared slots")
        mapped = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    try:
        return _prepare(items, steps, mapped, layout)
    finally:
        mapped.close()  # its views were _prepare's locals: gone


def _prepare(items: list, steps: list, mapped: mmap.mmap, layout: list) -> tuple:
    rows, hashes, dropped = [], [], {}
    arrays = [_view(mapped, offset, tuple(shape)) for offset, shape in layout]
    for row, slot, data in items:
        try:
            img = open_rgb(data)
            pixels = [np.asarray(step(img)) for step in steps]
            hashed = phash(img)
        except Exception:  # any failure on one image is that image's, not the chunk's
            dropped[row] = "decode_error"
            continue
        for array, px in zip(arrays, pixels, strict=True):
            array[slot] = px
        rows.append(row)
        hashes.append(hashed)
    return rows, hashes, dropped


images.WORKER_TASKS["score"] = prepare_rows


def decode_pool(node: Node) -> images.DecodePool:
    """The node's score decode workers, up to its budget, kept for every later shard and
    shared by the shard tasks of every GPU of the node. Started at once, while the scorer is
    built: each takes ~4 s to import open_clip, which unpickling the steps needs."""
    return node.pool(
        "score-decode",
        node.workers,
        lambda n, slots: images.DecodePool(
            n, COMMAND, eager=True, slots=slots, kind="score-decode"
        ),
    )


if __name__ == "__main__":
    images.serve()
