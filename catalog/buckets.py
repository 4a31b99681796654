"""Aspect-ratio buckets: the plan of a model's training shapes, and each image's bucket.

A plan is what kohya sd-scripts and SimpleTuner call one: every (width, height) whose sides are
multiples of `step`, lie within [min_side, max_side], whose area is at most `area` (the side of
the square is sqrt(area) rounded down to the step) and whose aspect ratio lies within
1/max_aspect .. max_aspect. An image goes to the bucket nearest its aspect ratio (width /
height, the absolute difference, ties to the lower ratio), is resized to cover the bucket
(scaled by the larger of the two side ratios) and center-cropped to it.

Bucket names are "WxH" (pixels). A model without a plan trains on squares of its resolution:
`BucketPlan.square(resolution)` is the one-bucket plan of that square.

Numpy and the standard library only: the trainer, mix, plan and encode all read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_STORED_ASPECT = 4  # a stored image's long side is at most this times the short side's target


@dataclass(frozen=True, slots=True)
class BucketPlan:
    area: int = 512 * 512  # the most pixels of a bucket (the base square's area)
    step: int = 64  # sides are multiples of this (64 px: 8 latent px)
    min_side: int = 256
    max_side: int = 1024
    max_aspect: float = 2.0  # aspect range 1/max_aspect .. max_aspect

    def __post_init__(self) -> None:
        if self.step <= 0 or self.step % 8:
            raise ValueError(f"bucket step {self.step}: must be a positive multiple of 8")
        if self.area < self.step * self.step:
            raise ValueError(f"bucket area {self.area}: below one step squared ({self.step}^2)")
        if not 0 < self.min_side <= self.max_side:
            raise ValueError(f"bucket sides {self.min_side}..{self.max_side}: not a range")
        if self.max_aspect < 1:
            raise ValueError(f"max_aspect {self.max_aspect}: must be >= 1")

    @classmethod
    def square(cls, resolution: int) -> BucketPlan:
        """The plan of one bucket, the `resolution` square (a model without buckets)."""
        return cls(
            area=resolution * resolution,
            step=resolution,
            min_side=resolution,
            max_side=resolution,
            max_aspect=1.0,
        )

    @classmethod
    def from_dict(cls, value: dict | None, resolution: int) -> BucketPlan:
        """A catalog setting (`buckets:` of a model): None -> the square plan."""
        if not value:
            return cls.square(resolution)
        value = dict(value)
        value.setdefault("area", resolution * resolution)
        return cls(**value)

    def to_dict(self) -> dict:
        return {
            "area": self.area,
            "step": self.step,
            "min_side": self.min_side,
            "max_side": self.max_side,
            "max_aspect": self.max_aspect,
        }

    @property
    def is_square(self) -> bool:
        return len(self.sizes()) == 1

    def sizes(self) -> np.ndarray:
        """int32 [K, 2] (width, height) of the buckets, by aspect ratio (width / height) up."""
        return _sizes(self)

    def names(self) -> list[str]:
        return [name(w, h) for w, h in self.sizes().tolist()]

    def assign(self, widths, heights) -> np.ndarray:
        """int32 bucket index (into `sizes()`) of each image, vectorised."""
        widths = np.asarray(widths, np.float64)
        heights = np.asarray(heights, np.float64)
        if np.any(widths <= 0) or np.any(heights <= 0):
            raise ValueError("an image has no pixels (width or height <= 0)")
        sizes = self.sizes()
        bucket_aspects = sizes[:, 0] / sizes[:, 1]
        aspects = widths / heights
        # Bucket aspects are sorted: the nearest is one of the two around each image's aspect.
        upper = np.clip(np.searchsorted(bucket_aspects, aspects), 1, len(sizes) - 1)
        lower = upper - 1
        if len(sizes) == 1:
            return np.zeros(len(aspects), np.int32)
        take_upper = np.abs(bucket_aspects[upper] - aspects) < np.abs(
            bucket_aspects[lower] - aspects
        )
        return np.where(take_upper, upper, lower).astype(np.int32)

    def bucket_of(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of one image's bucket."""
        w, h = self.sizes()[int(self.assign([width], [height])[0])].tolist()
        return w, h


def _sizes(plan: BucketPlan) -> np.ndarray:
    step = plan.step
    found = set()
    side = int(math.isqrt(plan.area) // step * step)
    if plan.min_side <= side <= plan.max_side:
        found.add((side, side))
    width = -(-plan.min_side // step) * step
    while width <= plan.max_side:
        height = min(plan.max_side, plan.area // width // step * step)
        if height >= plan.min_side:
            found.add((width, height))
            found.add((height, width))
        width += step
    kept = [(w, h) for w, h in found if max(w / h, h / w) <= plan.max_aspect + 1e-9]
    if not kept:
        raise ValueError(f"bucket plan {plan.to_dict()} holds no bucket")
    # By aspect; sizes of one aspect (a smaller square, say) by area down: the first is kept.
    kept.sort(key=lambda s: (s[0] / s[1], -s[0] * s[1]))
    unique, seen = [], set()
    for w, h in kept:
        ratio = round(w / h, 12)
        if ratio not in seen:
            seen.add(ratio)
            unique.append((w, h))
    return np.array(unique, np.int32)


def name(width: int, height: int) -> str:
    return f"{width}x{height}"


def parse(bucket: str) -> tuple[int, int]:
    """(width, height) of a bucket name "WxH"."""
    w, _, h = bucket.partition("x")
    return int(w), int(h)


def cover_box(width: int, height: int, bucket: tuple[int, int]) -> tuple[int, int, int, int]:
    """(resized width, resized height, left, top) that cover `bucket` and center-crop to it:
    scaled by the larger side ratio (never below the bucket's sides), crop offsets floored."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    new_w = max(bw, round(width * scale))
    new_h = max(bh, round(height * scale))
    return new_w, new_h, (new_w - bw) // 2, (new_h - bh) // 2


def stored_size(width: int, height: int, side: int) -> tuple[int, int]:
    """(width, height) an image is stored at in the shards: scaled down (never up), aspect kept,
    so its short side is at most `side` and its long side at most MAX_STORED_ASPECT x `side`.

    The short side rule keeps a model without buckets exactly where it was (its center square is
    cut from the same pixels as before) and covers every bucket of a plan whose area is at most
    `side`² without an upscale; the long side cap bounds a panorama's bytes.
    """
    scale = min(1.0, side / min(width, height), MAX_STORED_ASPECT * side / max(width, height))
    if scale >= 1.0:
        return width, height
    # The epsilon: a square's side times 64 / side must floor to 64, not 63.999... -> 63.
    return (
        max(1, math.floor(width * scale + 1e-9)),
        max(1, math.floor(height * scale + 1e-9)),
    )
