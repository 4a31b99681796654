"""score's decoders and slots: where a shard's images become network inputs.

`Slots` hold a few batches of network inputs, allocated once per shard; `Decoders` fill them
from image bytes, in threads or in the node's decode processes (score_decode.py). The scorer
(score.py) gathers its batches from the slots.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from tasks.curation.score_decode import SharedSlots, open_rgb, phash

if TYPE_CHECKING:
    from tasks.curation.score import Scorer


class Slots:
    """The network inputs of `num_slots` images, allocated once per shard.

    A decoder writes an image's inputs into a free slot and a batch is gathered from its
    images' slots, so the inputs held do not grow with the shard, and every large tensor a
    decoder makes is freed in its own thread (freed in another, glibc kept the memory in the
    decoders' arenas: the RSS crept up with every image). `shared`: the fast path's uint8
    slots in shared memory, written by decode processes (`score_decode.SharedSlots`).
    """

    def __init__(self, scorer: Scorer, num_slots: int, *, shared: bool = False):
        # Fast path: uint8 HWC pixels (0.35 MB an image at 224 + 256 px); else float32 CHW.
        made = [t for t in scorer.prepare(Image.new("RGB", (8, 8))) if t is not None]
        self.memory = None
        if shared:
            if not scorer.fast:
                raise ValueError("decode processes write the fast path's uint8 slots only")
            self.memory = SharedSlots([(num_slots, *t.shape) for t in made])
            self.inputs = [torch.from_numpy(a) for a in self.memory.arrays()]
        else:
            self.inputs = [
                torch.empty(
                    (num_slots, *t.shape),
                    dtype=t.dtype if isinstance(t, torch.Tensor) else torch.uint8,
                )
                for t in made
            ]
        self.same_input = scorer.same_input
        self.free = list(range(num_slots))
        # CUDA's fast path: two pinned batch buffers and each one's last copy (Scorer._stage).
        self.stages: list[tuple[list[torch.Tensor], torch.cuda.Event | None]] = []

    def write(self, slot: int, prepared: tuple) -> None:
        for buf, tensor in zip(self.inputs, (t for t in prepared if t is not None), strict=True):
            if isinstance(tensor, np.ndarray):  # the fast path's uint8 pixels
                buf[slot].numpy()[...] = tensor
            else:
                buf[slot].copy_(tensor)

    def prepared(self, slot: int) -> tuple:
        """What `Scorer.prepare` returned for the slot's image (views of the slot)."""
        views = [buf[slot] for buf in self.inputs]
        return (views[0], None, views[1]) if self.same_input else tuple(views)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()


def decode_one(scorer: Scorer, data: bytes, slots: Slots, slot: int) -> int | str:
    """pHash of one image's bytes, its network inputs written to `slot`; or the reason it
    cannot be scored."""
    try:
        img = open_rgb(data)
        prepared, hashed = scorer.prepare(img), phash(img)
    except Exception:  # any failure on one image is that image's, not the shard's
        return "decode_error"
    slots.write(slot, prepared)
    return hashed


class Decoders:
    """Where images are decoded into slots: threads (`workers`), or a decode pool's processes
    (`pool`, the fast path's uint8 slots in shared memory) in chunks of `chunk` images.
    `decode(i, slot, data)` queues one; `result(i)` waits for it: its pHash, or the reason it
    cannot be scored. Images are waited for in the order they were queued."""

    def __init__(self, scorer: Scorer, slots: Slots, workers: int, pool, chunk: int):
        self.scorer, self.slots, self.pool, self.chunk = scorer, slots, pool, chunk
        self.threads = None if pool else ThreadPoolExecutor(max_workers=workers)
        self.futures: dict[int, Future] = {}
        self.waiting: list[tuple[int, int, bytes]] = []  # the chunk being filled
        self.outcomes: dict[int, int | str] = {}

    def decode(self, i: int, slot: int, data: bytes) -> None:
        if self.threads is not None:
            self.futures[i] = self.threads.submit(decode_one, self.scorer, data, self.slots, slot)
            return
        self.waiting.append((i, slot, data))
        if len(self.waiting) == self.chunk:
            self.flush()

    def flush(self) -> None:
        if not self.waiting:
            return
        memory = self.slots.memory
        future = self.pool.submit(
            self.waiting,
            0,
            "score",
            steps=self.scorer.pil_tfs,
            memory=memory.path,
            identity=memory.identity,
            layout=memory.layout,
        )
        for i, _, _ in self.waiting:
            self.futures[i] = future
        self.waiting = []

    def result(self, i: int) -> int | str:
        if self.threads is not None:
            return self.futures.pop(i).result()
        if i not in self.outcomes:
            if i not in self.futures:  # still in the chunk being filled
                self.flush()
            rows, hashes, dropped = self.futures[i].result()
            for row, value in (*zip(rows, hashes, strict=True), *dropped.items()):
                del self.futures[row]
                self.outcomes[row] = value
        return self.outcomes.pop(i)

    def close(self) -> None:
        """No image decoded after this returns, so the slots may go: queued work is cancelled
        and running work waited for (after a failure too, when results are left unread: the
        memory's fd number is reused by the next shard's, which a late chunk would find at
        the path; the memory's identity, checked by the worker, is the second guard)."""
        if self.threads is not None:
            self.threads.shutdown(cancel_futures=True)
            return
        self.waiting = []
        in_flight = {id(f): f for f in self.futures.values()}.values()
        for future in in_flight:
            future.cancel()
        for future in in_flight:
            if not future.cancelled():
                future.exception()  # waits; its result or error is not wanted now
