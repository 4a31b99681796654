"""score: a shard's images -> LAION's scores, pHash, ViT-L/14 embedding: `scores/NNNNN.parquet`.

Each network gets LAION's own preprocessing (open_clip's bicubic resize + center crop, the
watermark model's 256x256 stretch) and its heads as published, so real weights reproduce
LAION's numbers, not near ones. The fp16 embedding is kept for semantic dedup. A shard streams
through decode -> preprocessing -> networks a few batches at a time: memory does not grow with it.

Two paths, the same preprocessing. The fast one (default): the CPU does only the steps that must
be PIL's (decode, resizes, crop, pHash) into uint8 slots; ToTensor and Normalize run per batch
on the device with the same IEEE float32 operations, so the network inputs are the same bits;
on CUDA the networks hold fp16 weights (the watermark model channels_last) and results come
back one batch late, so the host never waits for the batch it just queued. `fast=False` is the
path before it (float32 tensors made per image in the workers, fp16 autocast over fp32
weights), kept for the benchmark's baseline.
"""

from __future__ import annotations

import logging
import os
import tarfile
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from PIL import Image

from catalog.schema import ScoringModel
from sdtrain.atomic import atomic_path
from sdtrain.lazy import BUILD_LOCK
from tasks.curation import score_decode, selection

# 64-bit pHash, bit for bit imagehash's (with the process decoders, where it is computed).
from tasks.curation.score_decode import phash as phash
from tasks.curation.score_nets import (
    AestheticHead,
    NSFWHead,
    check_weights,
    clip_model,
    load_weights,
    watermark_classifier,
)

# The stage's error for a missing or wrong weights file, where the flows and the CLI catch it.
from tasks.curation.score_nets import ScoringWeightsError as ScoringWeightsError

# The scorer a shard's scores were made by, and its cache-key digest (the flows key by them).
from tasks.curation.score_nets import identity_digest as identity_digest
from tasks.curation.score_nets import scorer_identity as scorer_identity
from tasks.curation.score_slots import Decoders, Slots
from tasks.latents.images import DecodePool, image_members
from tasks.latents.images import read_images as read_tar_images
from tasks.runtime.node import Node, local_node
from tasks.runtime.shards import ShardStats, done_record, run_shard, stats_path

STAGE = "scores"
log = logging.getLogger(__name__)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(kw_only=True, slots=True)
class Scores:
    """Per image: the four scores, the 64-bit pHash and the fp16 embedding [N, D]."""

    aesthetic: np.ndarray
    similarity: np.ndarray
    pwatermark: np.ndarray
    punsafe: np.ndarray
    phash: np.ndarray
    embedding: np.ndarray


class Scorer:
    """The networks of one scoring model on one device, with their preprocessing.

    fast: the CPU side makes uint8 pixels and the device normalizes them per batch; on CUDA the
    networks run in fp16 weights. fast=False: today's path before that (see the module note).
    """

    def __init__(self, spec: ScoringModel, device: torch.device, seed: int = 0, *, fast=True):
        import open_clip

        if not spec.random_weights:  # every missing file named before minutes of building
            check_weights(spec)
        self.spec, self.device, self.fast = spec, device, fast
        # What it is built from (files hashed once per process), as the files are now: kept, as
        # they may be replaced while it lives.
        self.identity = scorer_identity(spec)
        with torch.random.fork_rng(devices=[]):  # seeded twins; other threads' RNG untouched
            torch.manual_seed(seed)
            self.embed = clip_model(spec, "embed")
            self.similarity = clip_model(spec, "similarity")
            dim = self.embed.visual.output_dim
            self.aesthetic, self.nsfw = AestheticHead(dim), NSFWHead(dim)
            self.watermark = watermark_classifier(spec.watermark_model)
        if not spec.random_weights:
            for role in ("aesthetic", "nsfw", "watermark"):
                load_weights(getattr(self, role), spec, role)
        for net in (self.embed, self.similarity, self.aesthetic, self.nsfw, self.watermark):
            net.to(device).eval().requires_grad_(False)
        # The fast path's CUDA networks: fp16 weights, as OpenAI's CLIP and LAION's
        # clip-retrieval ran them (fp16 keeps 3 more mantissa bits than bf16; these inference
        # activations stay far inside its range). Without autocast nn.MultiheadAttention takes
        # its fused path (SDPA). The heads stay fp32, on the fp32-normalized embedding.
        self.half = fast and device.type == "cuda"
        if self.half:
            for net in (self.embed, self.similarity, self.watermark):
                net.half()
            self.watermark.to(memory_format=torch.channels_last)
        # The transforms LAION used (clip's preprocess; the watermark model's own).
        mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
        self.embed_tf = open_clip.image_transform(
            self.embed.visual.image_size, is_train=False, mean=mean, std=std
        )
        self.similarity_tf = open_clip.image_transform(
            self.similarity.visual.image_size, is_train=False, mean=mean, std=std
        )
        from torchvision import transforms as T

        self.watermark_tf = T.Compose(
            [
                T.Resize((spec.watermark_side, spec.watermark_side)),
                T.ToTensor(),
                T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )
        self.tokenizer = open_clip.get_tokenizer("ViT-B-32")
        self.same_input = self.embed.visual.image_size == self.similarity.visual.image_size
        # The fast path: each transform's PIL steps run in the workers, its ToTensor (/255)
        # and Normalize on the device, per batch.
        tfs = [self.embed_tf] + ([] if self.same_input else [self.similarity_tf])
        self.pil_tfs = [pil_steps(tf) for tf in (*tfs, self.watermark_tf)]
        self.norms = [normalization(tf, device) for tf in (*tfs, self.watermark_tf)]
        self._255 = torch.tensor(255.0, device=device)

    def prepare(self, img: Image.Image) -> tuple:
        """CPU side of one image (run in worker threads). Fast: uint8 HWC pixels of each input
        (embed, similarity unless the same, watermark); else the networks' float32 tensors."""
        if self.fast:
            return tuple(np.asarray(tf(img)) for tf in self.pil_tfs)
        embed_px = self.embed_tf(img)
        similarity_px = None if self.same_input else self.similarity_tf(img)
        return embed_px, similarity_px, self.watermark_tf(img)

    def normalize(self, pixels_BHWC: torch.Tensor, which: int) -> torch.Tensor:
        """uint8 [B, H, W, C] on the device -> float32 [B, C, H, W], the same bits as
        torchvision's ToTensor + Normalize of each image: x / 255 (a tensor divisor: CUDA
        multiplies by the reciprocal of a Python-number divisor), then (x - mean) / std.
        The result keeps the NHWC strides (channels_last)."""
        mean, std = self.norms[which]
        x = pixels_BHWC.permute(0, 3, 1, 2).to(torch.float32)
        return x.div_(self._255).sub_(mean).div_(std)

    def _stage(self, slots: Slots, slot_ids: list[int]) -> list[torch.Tensor]:
        """A batch's uint8 inputs gathered from the slots, on the device. On CUDA through one
        of the slots' two pinned buffers, copied without blocking; a buffer is reused once its
        last copy is done (an event, long since passed: no wait on the networks). The buffers
        are the shard's (`Slots`), so shard tasks sharing the scorer in threads never share
        them."""
        n = len(slot_ids)
        if self.device.type != "cuda":
            return [
                gather(buf, slot_ids, torch.empty((n, *buf.shape[1:]), dtype=buf.dtype))
                for buf in slots.inputs
            ]
        if not slots.stages or slots.stages[0][0][0].shape[0] < n:
            slots.stages = [
                ([torch.empty(b[:n].shape, dtype=b.dtype).pin_memory() for b in slots.inputs], None)
                for _ in range(2)
            ]
        bufs, done = slots.stages.pop(0)
        if done is not None:
            done.synchronize()
        out = [
            gather(buf, slot_ids, host[:n]).to(self.device, non_blocking=True)
            for host, buf in zip(bufs, slots.inputs, strict=True)
        ]
        event = torch.cuda.Event()
        event.record()
        slots.stages.append((bufs, event))
        return out

    @torch.no_grad()
    def submit(self, slots: Slots, slot_ids: list[int], captions: list[str]) -> _Pending:
        """Queue one batch of slotted images; `.get()` of the result: `score`'s dict."""
        if not self.fast:
            return _Pending(self.score([slots.prepared(i) for i in slot_ids], captions))
        dev = self.device
        staged = self._stage(slots, slot_ids)
        tokens = self.tokenizer([c or "" for c in captions]).to(dev, non_blocking=True)
        dtype = torch.float16 if self.half else torch.float32
        embed_px = self.normalize(staged[0], 0).contiguous().to(dtype)
        similarity_px = (
            embed_px if self.same_input else self.normalize(staged[1], 1).contiguous().to(dtype)
        )
        layout = torch.channels_last if self.half else torch.contiguous_format
        watermark_px = self.normalize(staged[-1], -1).to(dtype).contiguous(memory_format=layout)
        image_emb = self.embed.encode_image(embed_px)
        sim_image = self.similarity.encode_image(similarity_px)
        sim_text = self.similarity.encode_text(tokens)
        watermark_logits = self.watermark(watermark_px)
        out = self._heads(image_emb, sim_image, sim_text, watermark_logits)
        if dev.type != "cuda":
            return _Pending({k: v.numpy() for k, v in out.items()})
        host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in out.items()}
        for k, v in out.items():
            host[k].copy_(v, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Pending({k: v.numpy() for k, v in host.items()}, event)

    def _heads(self, image_emb, sim_image, sim_text, watermark_logits) -> dict[str, torch.Tensor]:
        image_emb = F.normalize(image_emb.float(), dim=-1)
        similarity = (
            F.normalize(sim_image.float(), dim=-1) * F.normalize(sim_text.float(), dim=-1)
        ).sum(-1)
        return {
            "aesthetic": self.aesthetic(image_emb),
            "similarity": similarity,
            "pwatermark": F.softmax(watermark_logits.float(), dim=1)[:, 0],
            "punsafe": self.nsfw(image_emb),
            "embedding": image_emb.half(),
        }

    @torch.no_grad()
    def score(self, prepared: list[tuple], captions: list[str]) -> dict[str, np.ndarray]:
        """The old path's batch: float32 inputs stacked here, fp16 autocast on CUDA."""
        dev = self.device
        embed_px = torch.stack([p[0] for p in prepared]).to(dev)
        similarity_px = embed_px if self.same_input else torch.stack([p[1] for p in prepared])
        watermark_px = torch.stack([p[2] for p in prepared]).to(dev)
        tokens = self.tokenizer([c or "" for c in captions]).to(dev)
        use_fp16 = dev.type == "cuda"
        with torch.autocast(dev.type, dtype=torch.float16, enabled=use_fp16):
            image_emb = self.embed.encode_image(embed_px)
            sim_image = self.similarity.encode_image(similarity_px.to(dev))
            sim_text = self.similarity.encode_text(tokens)
            watermark_logits = self.watermark(watermark_px)
        out = self._heads(image_emb, sim_image, sim_text, watermark_logits)
        return {k: v.cpu().numpy() for k, v in out.items()}


def gather(buf: torch.Tensor, rows: list[int], out: torch.Tensor) -> torch.Tensor:
    """`out` = buf[rows], by numpy: one thread, no OpenMP team spinning beside the decoders."""
    np.take(buf.numpy(), rows, axis=0, out=out.numpy())
    return out


class _Pending:
    """One batch's results, on the host once `event` (the copy back) has passed."""

    def __init__(self, out: dict[str, np.ndarray], event=None):
        self.out, self.event = out, event

    def get(self) -> dict[str, np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        return self.out


def pil_steps(tf) -> list:
    """A torchvision Compose's steps before its ToTensor (open_clip's resize, center crop and
    RGB conversion; the watermark model's resize), as one callable on PIL images."""
    from torchvision import transforms as T

    steps = []
    for step in tf.transforms:
        if isinstance(step, T.ToTensor):
            break
        steps.append(step)
    rest = tf.transforms[len(steps) :]
    if len(rest) != 2 or not isinstance(rest[0], T.ToTensor) or type(rest[1]) is not T.Normalize:
        raise ValueError(f"expected PIL steps, then ToTensor and Normalize: {tf}")
    return T.Compose(steps)


def normalization(tf, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [3, 1, 1] float32 of a Compose's Normalize, as torchvision makes them."""
    norm = tf.transforms[-1]
    mean = torch.as_tensor(norm.mean, dtype=torch.float32, device=device).view(-1, 1, 1)
    std = torch.as_tensor(norm.std, dtype=torch.float32, device=device).view(-1, 1, 1)
    return mean, std


_scorers: dict[tuple[str, str, bool, str], Scorer] = {}


def load_scorer(spec: ScoringModel, device: torch.device, *, fast: bool = True) -> Scorer:
    """One Scorer per scoring model, device, path and process, shared by shard tasks in
    threads; new weights files (or settings) under the same name build a new one."""
    if not spec.random_weights:
        check_weights(spec)
    identity = identity_digest(scorer_identity(spec))  # digests cached per file
    with BUILD_LOCK:  # open_clip and timm import lazily too: see sdtrain/lazy.py
        key = (spec.name, str(device), fast, identity)
        if key not in _scorers:
            _scorers[key] = Scorer(spec, device, fast=fast)
        return _scorers[key]


def read_images(tar_path: Path, keys: set[str]) -> dict[str, bytes]:
    """The image bytes of `keys` from a shard's tar (only theirs are read)."""
    return read_tar_images(tar_path, keys, IMAGE_EXTENSIONS)


def score_images(
    scorer: Scorer,
    images: Iterable[bytes],
    captions: Iterable[str],
    *,
    batch_size: int,
    workers: int,
    ahead: int = 2,
    pool: DecodePool | None = None,
    chunk: int = score_decode.CHUNK,
) -> tuple[list[int], Scores, dict[int, str]]:
    """Score image bytes: (indices scored, their scores, drop reason per unscored index).

    Streamed: decoders prepare up to `ahead` batches beyond the one being filled, so memory
    holds a few batches of network inputs, not the shard's. A batch is the next `batch_size`
    decodable images in order, as when the whole input was decoded first, so the scores are
    the same bits. Decoders: `workers` threads, or `pool`'s processes (the fast path only,
    `score_decode.decode_pool`), `chunk` images per request, writing into shared slots.
    """
    rows: list[int] = []
    dropped: dict[int, str] = {}
    parts: dict[str, list[np.ndarray]] = {}
    slots = Slots(scorer, (ahead + 1) * batch_size, shared=pool is not None)
    batch: list[tuple[int, str, int]] = []  # (slot, caption, pHash) of the batch being filled
    queued: deque[tuple[_Pending, np.ndarray]] = deque()  # batches on the device, oldest first

    def collect() -> None:
        pending, hashes = queued.popleft()
        out = dict(pending.get())
        out["phash"] = hashes
        for name, values in out.items():
            parts.setdefault(name, []).append(values)

    def score_batch() -> None:
        # The batch's inputs are on their way to the device (or scored) once `submit` returns:
        # its slots are free. Its results are read after the next batch is queued.
        pending = scorer.submit(slots, [b[0] for b in batch], [b[1] for b in batch])
        queued.append((pending, np.array([b[2] for b in batch], np.uint64)))
        slots.free += [b[0] for b in batch]
        batch.clear()
        while len(queued) > 1:
            collect()

    def take() -> None:
        i, slot, caption = pending.popleft()
        result = decoders.result(i)
        if isinstance(result, str):
            dropped[i] = result
            slots.free.append(slot)
            return
        rows.append(i)
        batch.append((slot, caption, result))
        if len(batch) == batch_size:
            score_batch()

    pending: deque[tuple[int, int, str]] = deque()
    decoders = Decoders(scorer, slots, workers, pool, chunk)
    try:
        for i, (data, caption) in enumerate(zip(images, captions, strict=True)):
            while not slots.free:
                take()
            slot = slots.free.pop()
            decoders.decode(i, slot, data)
            pending.append((i, slot, caption))
        decoders.flush()
        while pending:
            take()
    finally:
        decoders.close()
        slots.close()
    if batch:
        score_batch()
    while queued:
        collect()
    dim = scorer.embed.visual.output_dim

    def cat(name: str, dtype, shape=(0,)) -> np.ndarray:
        return np.concatenate(parts[name]).astype(dtype) if rows else np.zeros(shape, dtype)

    scores = Scores(
        aesthetic=cat("aesthetic", np.float32),
        similarity=cat("similarity", np.float32),
        pwatermark=cat("pwatermark", np.float32),
        punsafe=cat("punsafe", np.float32),
        phash=cat("phash", np.uint64),
        embedding=cat("embedding", np.float16, (0, dim)),
    )
    return rows, scores, dropped


def scores_table(keys: list[str], scores: Scores) -> pa.Table:
    dim = scores.embedding.shape[1]
    return pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "aesthetic": scores.aesthetic,
            "similarity": scores.similarity,
            "pwatermark": scores.pwatermark,
            "punsafe": scores.punsafe,
            "phash": pa.array(scores.phash, pa.uint64()),
            "embedding": pa.FixedSizeListArray.from_arrays(
                pa.array(scores.embedding.reshape(-1), pa.float16()), dim
            ),
        }
    )


def score_shard(
    root: Path,
    source: str,
    shard: str,
    spec: ScoringModel,
    *,
    device: str | None = None,
    batch_size: int | None = None,
    workers: int | None = None,
    fast: bool = True,
    processes: bool | None = None,
    node: Node | None = None,
) -> ShardStats:
    """Score the fetched images of one shard (status `success` rows of its sample table).

    processes: decode in the node's kept decode processes (`score_decode.decode_pool`, the
    fast path only) rather than threads; default `decode_in_processes` (SDPIPE_SCORE_DECODE,
    else on CUDA's fast path, where the CPU side is the limit and threads meet at the GIL).
    node: the node whose decode processes these are (default: this process's, `local_node`),
    up to its budget of them. workers: decode threads; default every core on CUDA's fast
    path, else up to 8.
    fast=False: the old path (the benchmark's baseline)."""
    table_path = root / source / "shards" / f"{shard}.parquet"
    tar_path = table_path.with_suffix(".tar")

    def work(stats: ShardStats) -> None:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        in_processes = decode_in_processes(fast, dev) if processes is None else processes
        if in_processes and not fast:
            raise ValueError("decode processes serve the fast path only (fast=True)")
        pool = score_decode.decode_pool(node or local_node()) if in_processes else None
        scorer = load_scorer(spec, dev, fast=fast)
        cores = os.cpu_count() or 1
        default_workers = cores if fast and dev.type == "cuda" else min(8, cores)
        table = pq.read_table(table_path, columns=["key", "caption", "status"]).to_pylist()
        rows = [r for r in table if r["status"] == "success"]
        stats.num_in = len(rows)
        with tarfile.open(tar_path) as tar:
            members = image_members(tar, {r["key"] for r in rows}, IMAGE_EXTENSIONS)
            present = [r for r in rows if r["key"] in members]
            if len(present) < len(rows):
                stats.drop("missing_image", len(rows) - len(present))
            # Each image is read as the decoders reach it, in sample-table order.
            scored, scores, dropped = score_images(
                scorer,
                (tar.extractfile(members[r["key"]]).read() for r in present),
                [r["caption"] for r in present],
                batch_size=batch_size or spec.batch_size,
                workers=workers or default_workers,
                pool=pool,
            )
        for reason in dropped.values():
            stats.drop(reason)
        out = scores_table([present[i]["key"] for i in scored], scores)
        with atomic_path(root / source / STAGE / f"{shard}.parquet") as tmp:
            pq.write_table(out, tmp)
        stats.num_out = out.num_rows
        stats.extra = {"scorer": spec.name, "scorer_identity": identity, "device": str(dev)}

    if not spec.random_weights:  # every missing file named before a digest is taken
        check_weights(spec)
    identity = scorer_identity(spec)
    forget_other_scorer(root, source, shard, identity)
    return run_shard(root, source, STAGE, shard, work)


DECODE_ENV = "SDPIPE_SCORE_DECODE"


def decode_in_processes(fast: bool, device: torch.device) -> bool:
    """Where score decodes by default: `SDPIPE_SCORE_DECODE` (`threads` or `processes`), else
    in processes on CUDA's fast path (the CPU side is the limit there) and threads elsewhere."""
    value = os.environ.get(DECODE_ENV, "").strip().lower()
    if value not in ("", "threads", "processes"):
        raise ValueError(f"{DECODE_ENV}={value!r}: expected 'threads' or 'processes'")
    if value:
        return value == "processes" and fast
    return fast and device.type == "cuda"


def shard_done(root: Path, source: str, shard: str, identity: dict) -> bool:
    """The shard's record is there, its outputs intact (`done_record`), and it was scored by
    the scorer of `identity` (`scorer_identity`): scores of another scorer are not done."""
    record = done_record(root, source, STAGE, shard)
    return record is not None and _scored_by(record, identity)


def _scored_by(record: ShardStats, identity: dict) -> bool:
    recorded = record.extra.get("scorer_identity")
    if recorded is None:  # scored before identities were recorded: its scorer's name only
        return record.extra.get("scorer") == identity["model"]
    return recorded == identity


def forget_other_scorer(root: Path, source: str, shard: str, identity: dict) -> bool:
    """True if the shard is scored by `identity`'s scorer; a record of another scorer (other
    weights or settings under the same name too) is removed, with a warning, so the shard is
    scored again: its scores, pHashes and embeddings are that scorer's."""
    record = done_record(root, source, STAGE, shard)
    if record is None:
        return False
    if _scored_by(record, identity):
        return True
    log.warning(
        "score %s/%s: scored by another scorer (%s); scoring it again",
        source,
        shard,
        record.extra.get("scorer_identity") or record.extra.get("scorer"),
    )
    stats_path(root, source, STAGE, shard).unlink(missing_ok=True)
    selection.forget(root, source)  # chosen from these scores: chosen again from the new ones
    return False
