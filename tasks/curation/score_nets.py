"""The score stage's networks as LAION published them: the aesthetic and NSFW heads, the
watermark classifier, the CLIP models, and their weights files (where each is expected, the
error naming a missing one and where its published copy is). tasks/curation/score.py runs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from catalog.schema import ScoringModel

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


def clip_model(spec: ScoringModel, role: str):
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


# A weights file's digest per (path, size, mtime): hashed once per process, not per shard.
_digests: dict[tuple[str, int, int], str] = {}
_digest_lock = threading.Lock()


def file_digest(path: Path) -> str:
    """sha256 (16 hex digits) of a file's bytes, cached in this process by its resolved path,
    size and modification time (a file replaced under the same name is hashed again)."""
    path = path.resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _digest_lock:  # shard tasks in threads: one of them hashes, the others wait
        if key not in _digests:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            _digests[key] = h.hexdigest()[:16]
        return _digests[key]


def scorer_identity(spec: ScoringModel) -> dict:
    """What a shard's scores were made by: the model's name, a digest of its networks'
    settings (architectures, configs, the watermark side; not the batch size or the files'
    paths), and each network's weights file digest, or `random` for the seeded random twins.
    Portable: no path, host or mtime, so a copied data root is done elsewhere."""
    settings = {
        k: v
        for k, v in dataclasses.asdict(spec).items()
        if k not in ("name", "kind", "batch_size") and not k.endswith("_weights")
    }
    text = json.dumps(settings, sort_keys=True)
    return {
        "model": spec.name,
        "config": hashlib.sha256(text.encode()).hexdigest()[:16],
        "weights": (
            "random"
            if spec.random_weights
            else {role: file_digest(weights_path(spec, role)) for role in ROLES}
        ),
    }


def identity_digest(identity: dict) -> str:
    """A short digest of `scorer_identity`: part of the score tasks' cache keys."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
