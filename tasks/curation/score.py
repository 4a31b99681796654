"""score: a shard's images -> LAION's scores, pHash, ViT-L/14 embedding: `scores/NNNNN.parquet`.

Each network gets LAION's own preprocessing (open_clip's bicubic resize + center crop, the
watermark model's 256x256 stretch) and its heads as published, so real weights reproduce
LAION's numbers, not near ones. The fp16 embedding is kept for semantic dedup. A shard streams
through decode -> preprocessing -> networks a few batches at a time: memory does not grow with it.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.fft
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from catalog.schema import ScoringModel
from sdtrain.atomic import atomic_path
from sdtrain.lazy import BUILD_LOCK
from tasks.runtime.shards import ShardStats, run_shard

STAGE = "scores"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# Where each published weights file comes from, for the error that names a missing one.
ROLES = ("embed", "similarity", "aesthetic", "nsfw", "watermark")
HF, GH = "https://huggingface.co/timm", "https://github.com"
PUBLISHED = {
    "embed": f"open_clip_pytorch_model.bin of {HF}/vit_large_patch14_clip_224.openai",
    "similarity": f"open_clip_pytorch_model.bin of {HF}/vit_base_patch32_clip_224.openai",
    "aesthetic": f"{GH}/christophschuhmann/improved-aesthetic-predictor/raw/main/"
    "sac+logos+ava1-l14-linearMSE.pth",
    "nsfw": f"{GH}/LAION-AI/CLIP-based-NSFW-Detector/raw/main/models/"
    "clip_ViT-L-14_openai_binary_nsfw_head.pth",
    "watermark": f"{GH}/LAION-AI/LAION-5B-WatermarkDetection/releases/download/1.0/"
    "watermark_model_v1.pt",
}


class ScoringWeightsError(Exception):
    """A scoring model's weights file is missing or is not what the model expects."""


class AestheticHead(nn.Module):
    """LAION improved-aesthetic-predictor V2 (`sac+logos+ava1-l14-linearMSE.pth`).

    As published: no activations between the linear layers; input the L2-normalized embedding.
    """

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, emb_BD: torch.Tensor) -> torch.Tensor:
        return self.layers(emb_BD).squeeze(-1)


class _Normalization(nn.Module):
    """Keras `Normalization` as the NSFW head's PyTorch port stores it (mean, variance)."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("variance", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.variance.sqrt() + 1e-10)


class NSFWHead(nn.Module):
    """LAION CLIP-based NSFW detector for ViT-L/14 (`clip_ViT-L-14_openai_binary_nsfw_head.pth`)."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.norm = _Normalization(dim)
        self.linear_1 = nn.Linear(dim, 64)
        self.linear_2 = nn.Linear(64, 512)
        self.linear_3 = nn.Linear(512, 256)
        self.linear_4 = nn.Linear(256, 1)

    def forward(self, emb_BD: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.linear_1(self.norm(emb_BD)))
        x = F.relu(self.linear_2(x))
        x = F.relu(self.linear_3(x))
        return torch.sigmoid(self.linear_4(x)).squeeze(-1)


def watermark_classifier(arch: str) -> nn.Module:
    """LAION-5B watermark detector: a timm EfficientNet with LAION's 3-layer head (2 classes,
    index 0 = watermark), as `watermark_model_v1.pt` stores it."""
    import timm

    model = timm.create_model(arch, pretrained=False, num_classes=2)
    model.classifier = nn.Sequential(
        nn.Linear(model.num_features, 625),
        nn.ReLU(),
        nn.Dropout(p=0.3),
        nn.Linear(625, 256),
        nn.ReLU(),
        nn.Linear(256, 2),
    )
    return model


def weights_path(spec: ScoringModel, role: str) -> Path:
    """The local file of one network's weights: absolute, or under `SDPIPE_WEIGHTS`."""
    path = Path(os.path.expanduser(getattr(spec, f"{role}_weights")))
    if path.is_absolute():
        return path
    return Path(os.environ.get("SDPIPE_WEIGHTS") or "weights").absolute() / path


def check_weights(spec: ScoringModel) -> None:
    """Fail naming every missing weights file and where its published copy is."""
    missing = [r for r in ROLES if not weights_path(spec, r).is_file()]
    if missing:
        listed = "; ".join(
            f"{r}_weights: {weights_path(spec, r)} (get {PUBLISHED[r]})" for r in missing
        )
        raise ScoringWeightsError(
            f"scoring model {spec.name!r}: weights file(s) not found: {listed}. Put each file "
            f"at its path, or point {spec.name}.<net>_weights in models.yaml at it (relative "
            "paths are under SDPIPE_WEIGHTS, default ./weights)"
        )


def load_weights(module: nn.Module, spec: ScoringModel, role: str) -> None:
    path = weights_path(spec, role)
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ScoringWeightsError(f"{path} is not the {role} model's weights: {e}") from None


def _clip(spec: ScoringModel, role: str):
    import open_clip

    config = getattr(spec, f"{role}_config")
    if config:
        model = open_clip.CLIP(**config)
    else:
        model = open_clip.create_model(getattr(spec, f"{role}_model"), pretrained=None)
    if not spec.random_weights:
        path = weights_path(spec, role)
        try:
            open_clip.load_checkpoint(model, str(path))
        except RuntimeError as e:
            raise ScoringWeightsError(f"{path} is not the {role} model's weights: {e}") from None
    return model


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
    """The networks of one scoring model on one device, with their preprocessing."""

    def __init__(self, spec: ScoringModel, device: torch.device, seed: int = 0):
        import open_clip

        if not spec.random_weights:  # every missing file named before minutes of building
            check_weights(spec)
        self.spec, self.device = spec, device
        with torch.random.fork_rng(devices=[]):  # seeded twins; other threads' RNG untouched
            torch.manual_seed(seed)
            self.embed = _clip(spec, "embed")
            self.similarity = _clip(spec, "similarity")
            dim = self.embed.visual.output_dim
            self.aesthetic, self.nsfw = AestheticHead(dim), NSFWHead(dim)
            self.watermark = watermark_classifier(spec.watermark_model)
        if not spec.random_weights:
            for role in ("aesthetic", "nsfw", "watermark"):
                load_weights(getattr(self, role), spec, role)
        for net in (self.embed, self.similarity, self.aesthetic, self.nsfw, self.watermark):
            net.to(device).eval().requires_grad_(False)
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

    def prepare(self, img: Image.Image) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """CPU side of one image: the networks' input tensors (run in worker threads)."""
        embed_px = self.embed_tf(img)
        similarity_px = None if self.same_input else self.similarity_tf(img)
        return embed_px, similarity_px, self.watermark_tf(img)

    @torch.no_grad()
    def score(self, prepared: list[tuple], captions: list[str]) -> dict[str, np.ndarray]:
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
        image_emb = F.normalize(image_emb.float(), dim=-1)
        similarity = (
            F.normalize(sim_image.float(), dim=-1) * F.normalize(sim_text.float(), dim=-1)
        ).sum(-1)
        return {
            "aesthetic": self.aesthetic(image_emb).cpu().numpy(),
            "similarity": similarity.cpu().numpy(),
            "pwatermark": F.softmax(watermark_logits.float(), dim=1)[:, 0].cpu().numpy(),
            "punsafe": self.nsfw(image_emb).cpu().numpy(),
            "embedding": image_emb.half().cpu().numpy(),
        }


_scorers: dict[tuple[str, str], Scorer] = {}


def load_scorer(spec: ScoringModel, device: torch.device) -> Scorer:
    """One Scorer per scoring model, device and process, shared by shard tasks in threads."""
    with BUILD_LOCK:  # open_clip and timm import lazily too: see sdtrain/lazy.py
        key = (spec.name, str(device))
        if key not in _scorers:
            _scorers[key] = Scorer(spec, device)
        return _scorers[key]


def phash(img: Image.Image) -> int:
    """64-bit perceptual hash, bit for bit `imagehash.phash`: the 8x8 lowest DCT frequencies of
    the 32x32 grayscale image against their median, first coefficient as the highest bit."""
    pixels = np.asarray(img.convert("L").resize((32, 32), Image.Resampling.LANCZOS), np.float64)
    low = scipy.fft.dct(scipy.fft.dct(pixels, axis=0), axis=1)[:8, :8]
    bits = np.packbits((low > np.median(low)).reshape(-1))
    return int.from_bytes(bits.tobytes(), "big")


def read_images(tar_path: Path, keys: set[str]) -> dict[str, bytes]:
    out = {}
    with tarfile.open(tar_path) as tar:
        for member in tar:
            key, _, ext = member.name.partition(".")
            if key in keys and ext.lower() in IMAGE_EXTENSIONS and member.isfile():
                out[key] = tar.extractfile(member).read()
    return out


def image_members(tar: tarfile.TarFile, keys: set[str]) -> dict[str, tarfile.TarInfo]:
    """key -> the member holding its image, for `keys` (the last one, as `read_images` keeps):
    headers only, no image bytes are read."""
    found = {}
    while (member := tar.next()) is not None:
        # tarfile keeps every header it reads; three per sample would grow with the shard.
        tar.members.clear()
        key, _, ext = member.name.partition(".")
        if key in keys and ext.lower() in IMAGE_EXTENSIONS and member.isfile():
            found[key] = member
    return found


class _Slots:
    """The network inputs of `num_slots` images, allocated once per shard.

    A decoder writes an image's inputs into a free slot and a batch is gathered from its
    images' slots, so the inputs held do not grow with the shard, and every large tensor a
    decoder makes is freed in its own thread (freed in another, glibc kept the memory in the
    decoders' arenas: the RSS crept up with every image).
    """

    def __init__(self, scorer: Scorer, num_slots: int):
        shapes = [t.shape for t in scorer.prepare(Image.new("RGB", (8, 8))) if t is not None]
        self.inputs = [torch.empty((num_slots, *shape)) for shape in shapes]
        self.same_input = scorer.same_input
        self.free = list(range(num_slots))

    def write(self, slot: int, prepared: tuple) -> None:
        for buf, tensor in zip(self.inputs, (t for t in prepared if t is not None), strict=True):
            buf[slot].copy_(tensor)

    def prepared(self, slot: int) -> tuple:
        """What `Scorer.prepare` returned for the slot's image (views of the slot)."""
        views = [buf[slot] for buf in self.inputs]
        return (views[0], None, views[1]) if self.same_input else tuple(views)


def _decode(scorer: Scorer, data: bytes, slots: _Slots, slot: int) -> int | str:
    """pHash of one image's bytes, its network inputs written to `slot`; or the reason it
    cannot be scored."""
    try:
        img = Image.open(io.BytesIO(data))
        img = img.convert("RGB")
    except Exception:  # any decoder failure is this one image's, not the shard's
        return "decode_error"
    slots.write(slot, scorer.prepare(img))
    return phash(img)


def score_images(
    scorer: Scorer,
    images: Iterable[bytes],
    captions: Iterable[str],
    *,
    batch_size: int,
    workers: int,
    ahead: int = 2,
) -> tuple[list[int], Scores, dict[int, str]]:
    """Score image bytes: (indices scored, their scores, drop reason per unscored index).

    Streamed: worker threads decode and prepare up to `ahead` batches beyond the one being
    filled, so memory holds a few batches of network inputs, not the shard's. A batch is the
    next `batch_size` decodable images in order, as when the whole input was decoded first, so
    the scores are the same bits.
    """
    rows: list[int] = []
    dropped: dict[int, str] = {}
    parts: dict[str, list[np.ndarray]] = {}
    slots = _Slots(scorer, (ahead + 1) * batch_size)
    batch: list[tuple[int, str, int]] = []  # (slot, caption, pHash) of the batch being filled

    def score_batch() -> None:
        out = scorer.score([slots.prepared(b[0]) for b in batch], [b[1] for b in batch])
        out["phash"] = np.array([b[2] for b in batch], np.uint64)
        for name, values in out.items():
            parts.setdefault(name, []).append(values)
        slots.free += [b[0] for b in batch]
        batch.clear()

    def take() -> None:
        i, slot, caption, decoded = pending.popleft()
        result = decoded.result()
        if isinstance(result, str):
            dropped[i] = result
            slots.free.append(slot)
            return
        rows.append(i)
        batch.append((slot, caption, result))
        if len(batch) == batch_size:
            score_batch()

    pending: deque[tuple[int, int, str, Future]] = deque()
    with ThreadPoolExecutor(max_workers=workers) as pool:  # PIL decodes without the GIL
        for i, (data, caption) in enumerate(zip(images, captions, strict=True)):
            while not slots.free:
                take()
            slot = slots.free.pop()
            pending.append((i, slot, caption, pool.submit(_decode, scorer, data, slots, slot)))
        while pending:
            take()
    if batch:
        score_batch()
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
) -> ShardStats:
    """Score the fetched images of one shard (status `success` rows of its sample table)."""
    table_path = root / source / "shards" / f"{shard}.parquet"
    tar_path = table_path.with_suffix(".tar")

    def work(stats: ShardStats) -> None:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        scorer = load_scorer(spec, dev)
        table = pq.read_table(table_path, columns=["key", "caption", "status"]).to_pylist()
        rows = [r for r in table if r["status"] == "success"]
        stats.num_in = len(rows)
        with tarfile.open(tar_path) as tar:
            members = image_members(tar, {r["key"] for r in rows})
            present = [r for r in rows if r["key"] in members]
            if len(present) < len(rows):
                stats.drop("missing_image", len(rows) - len(present))
            # Each image is read as the decoders reach it, in sample-table order.
            scored, scores, dropped = score_images(
                scorer,
                (tar.extractfile(members[r["key"]]).read() for r in present),
                [r["caption"] for r in present],
                batch_size=batch_size or spec.batch_size,
                workers=workers or min(8, os.cpu_count() or 1),
            )
        for reason in dropped.values():
            stats.drop(reason)
        out = scores_table([present[i]["key"] for i in scored], scores)
        with atomic_path(root / source / STAGE / f"{shard}.parquet") as tmp:
            pq.write_table(out, tmp)
        stats.num_out = out.num_rows
        stats.extra = {"scorer": spec.name, "device": str(dev)}

    return run_shard(root, source, STAGE, shard, work)
