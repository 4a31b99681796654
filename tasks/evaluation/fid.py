"""FID: pytorch-fid's Inception-v3 pool features, their streamed moments, the Frechet distance.

torchvision's Inception-v3 is not the FID network: the TF graph that defined FID pools without
counting padding and max-pools in its last block, and has its own weights file. Published FIDs
compare only with both and with pytorch-fid's resize to 299 (bilinear, no antialias, [-1, 1]).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchvision.models import inception as tv

SIDE = 299
DIM = 2048
WEIGHTS_URL = (
    "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
    "pt_inception-2015-12-05-6726825d.pth"
)


class FIDWeightsError(Exception):
    """The FID network's weights file is missing or is not the FID Inception's."""


def _pool_without_padding(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


def _max_pool(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(x, kernel_size=3, stride=1, padding=1)


class _TFPooling:
    """Put before a torchvision Inception block: its pooling branch pooled as the TF graph
    pools it (`tf_pool`), the other branches its own."""

    tf_pool = staticmethod(_pool_without_padding)

    def _forward(self, x):
        out = super()._forward(x)
        out[-1] = self.branch_pool(self.tf_pool(x))
        return out


# The TF graph's blocks: torchvision's, with the pooling branch pooled as TF pools it.
class _InceptionA(_TFPooling, tv.InceptionA):
    pass


class _InceptionC(_TFPooling, tv.InceptionC):
    pass


class _InceptionE1(_TFPooling, tv.InceptionE):
    pass


class _InceptionE2(_TFPooling, tv.InceptionE):
    tf_pool = staticmethod(_max_pool)  # the last block max-pools


def fid_inception(*, init_weights: bool = False) -> tv.Inception3:
    """The FID Inception-v3, 1008 classes as the TF graph, with random weights (torchvision's
    truncated-normal init with `init_weights`: slower to build, but its features do not vanish
    through the 94 layers the way PyTorch's default init makes them)."""
    net = tv.Inception3(num_classes=1008, aux_logits=False, init_weights=init_weights)
    net.Mixed_5b = _InceptionA(192, pool_features=32)
    net.Mixed_5c = _InceptionA(256, pool_features=64)
    net.Mixed_5d = _InceptionA(288, pool_features=64)
    net.Mixed_6b = _InceptionC(768, channels_7x7=128)
    net.Mixed_6c = _InceptionC(768, channels_7x7=160)
    net.Mixed_6d = _InceptionC(768, channels_7x7=160)
    net.Mixed_6e = _InceptionC(768, channels_7x7=192)
    net.Mixed_7b = _InceptionE1(1280)
    net.Mixed_7c = _InceptionE2(2048)
    return net


def weights_path(name: str) -> Path:
    """A weights file: absolute, or under `SDPIPE_WEIGHTS` (default ./weights)."""
    path = Path(os.path.expanduser(name))
    if path.is_absolute():
        return path
    return Path(os.environ.get("SDPIPE_WEIGHTS") or "weights").absolute() / path


class FIDFeatures:
    """The 2048-d pool features of images, on one device."""

    def __init__(self, weights: str, device: torch.device, *, random_weights: bool = False):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the random twin is the same network every time
            self.net = fid_inception(init_weights=random_weights)
        if not random_weights:
            path = weights_path(weights)
            if not path.is_file():
                raise FIDWeightsError(
                    f"FID weights not found: {path} (get {WEIGHTS_URL}, or point the eval set's "
                    "fid_weights at it; relative paths are under SDPIPE_WEIGHTS, default "
                    "./weights)"
                )
            state = torch.load(path, map_location="cpu", weights_only=True)
            try:
                self.net.load_state_dict(state, strict=True)
            except RuntimeError as e:
                raise FIDWeightsError(f"{path} is not the FID Inception's weights: {e}") from None
        self.net.fc = nn.Identity()  # features are the pool output; the logits are unused
        self.net.to(device).eval().requires_grad_(False)
        self.device = device

    @torch.no_grad()
    def __call__(self, images: list[Image.Image]) -> np.ndarray:
        """float64 [N, 2048] for RGB images of any sizes, in one batch: each image resized
        alone, as pytorch-fid resizes a batch (bilinear, no antialias): a row per image is the
        same whatever the sizes of the others."""
        x = torch.cat([resized(im, self.device) for im in images])
        return self.net(2 * x - 1).double().cpu().numpy()


def resized(image: Image.Image, device: torch.device) -> torch.Tensor:
    """[1, 3, 299, 299] float32 in [0, 1]: pytorch-fid's resize of one image of any size."""
    pixels = _to_tensor(image)[None].to(device)
    return F.interpolate(pixels, size=(SIDE, SIDE), mode="bilinear", align_corners=False)


def _to_tensor(image: Image.Image) -> torch.Tensor:
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1)


def center_square(image: Image.Image) -> Image.Image:
    """The largest centered square (reference photos are rarely square; samples are)."""
    w, h = image.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return image.crop((left, top, left + side, top + side))


@dataclass(slots=True)
class Moments:
    """Sums of features and of their outer products, in float64: a set of any size in memory of
    one D x D matrix, merged batch by batch. While the set has at most D rows they are kept too:
    the distance then needs an n x n eigenproblem instead of two D x D ones."""

    count: int
    total: np.ndarray  # [D]
    outer: np.ndarray  # [D, D]
    rows: list[np.ndarray] | None  # the features, while count <= D

    @classmethod
    def empty(cls, dim: int = DIM) -> Moments:
        return cls(0, np.zeros(dim), np.zeros((dim, dim)), [])

    def add(self, features: np.ndarray) -> None:
        features = np.asarray(features, np.float64)
        self.count += len(features)
        self.total += features.sum(0)
        self.outer += features.T @ features
        if self.rows is not None:
            self.rows = self.rows + [features] if self.count <= len(self.total) else None

    def mean_cov(self) -> tuple[np.ndarray, np.ndarray]:
        """The mean and the unbiased covariance (n - 1), as numpy's `cov` gives them."""
        if self.count < 2:
            raise ValueError(f"FID needs at least 2 images, got {self.count}")
        mu = self.total / self.count
        cov = (self.outer - self.count * np.outer(mu, mu)) / (self.count - 1)
        return mu, cov

    def save(self, file) -> None:
        np.savez(file, count=self.count, total=self.total, outer=self.outer)

    @classmethod
    def load(cls, path: Path) -> Moments:
        with np.load(path) as f:
            return cls(int(f["count"]), f["total"], f["outer"], None)


def frechet_distance(mu1, cov1, mu2, cov2) -> float:
    """|mu1 - mu2|^2 + tr(C1) + tr(C2) - 2 tr((C1 C2)^1/2).

    tr((C1 C2)^1/2) is the sum of the square roots of the eigenvalues of C1 C2, which are those
    of the symmetric S C2 S with S = C1^1/2: real and non-negative, so no complex sqrtm and no
    trouble with the singular covariances of sets smaller than 2048.
    """
    w, v = np.linalg.eigh(cov1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    return _distance(mu1, cov1, mu2, cov2, np.linalg.eigvalsh(root @ cov2 @ root))


def _distance(mu1, cov1, mu2, cov2, eig) -> float:
    diff = mu1 - mu2
    trace_sqrt = np.sqrt(np.clip(eig, 0, None)).sum()
    return float(diff @ diff + np.trace(cov1) + np.trace(cov2) - 2 * trace_sqrt)


def fid(a: Moments, b: Moments) -> float:
    """The Frechet distance of two feature sets. With C1 = X'X / (n - 1) for the n centered rows
    X of a small set, C1 C2 has the nonzero eigenvalues of X C2 X' / (n - 1), n x n."""
    mu1, cov1 = a.mean_cov()
    mu2, cov2 = b.mean_cov()
    small, other = (a, cov2) if a.rows is not None else (b, cov1)
    if small.rows is None:
        return frechet_distance(mu1, cov1, mu2, cov2)
    x = np.concatenate(small.rows) - small.total / small.count
    eig = np.linalg.eigvalsh(x @ other @ x.T / (small.count - 1))
    return _distance(mu1, cov1, mu2, cov2, eig)


def moments_of(features: FIDFeatures, images: Iterable[Image.Image], batch_size: int) -> Moments:
    """The moments of a stream of images, `batch_size` at a time."""
    moments, batch = Moments.empty(), []
    for image in images:
        batch.append(image)
        if len(batch) == batch_size:
            moments.add(features(batch))
            batch = []
    if batch:
        moments.add(features(batch))
    return moments
