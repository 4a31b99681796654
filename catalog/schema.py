"""Typed catalog entries: sources, filter profiles, datasets, phases, models.

Entries are frozen dataclasses built from YAML by `catalog.loader`; the loader, not these
classes, owns error messages (file, field, value), so the classes stay plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SourceKind = Literal["url", "archive", "folder", "demo"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Source:
    """Where a source's data lives and how it is laid out.

    kind: `url` sources ship metadata with image URLs (filtered before any image is fetched);
    `archive` sources ship images in archives; `folder` is a local tree; `demo` is generated.
    """

    name: str
    kind: SourceKind
    location: str
    license: str
    homepage: str = ""
    revision: str = ""
    samples_per_shard: int = 10_000
    resolution: int = 512  # side of the square images in the shards
    model: str = "sd15"  # whose VAE encodes this source's latents
    profile: str  # the loosest profile the source is built at; stricter views query over it
    options: dict = field(default_factory=dict)


@dataclass(kw_only=True, slots=True, frozen=True)
class FilterProfile:
    """Thresholds a sample must meet. None disables a rule."""

    name: str
    min_aesthetic: float | None = None
    min_similarity: float | None = None
    max_pwatermark: float | None = None
    max_punsafe: float | None = None
    min_side: int = 0
    dedup: tuple[str, ...] = ("url", "sha256")


@dataclass(kw_only=True, slots=True, frozen=True)
class Dataset:
    """A named view over a source: the source's samples that pass a profile."""

    name: str
    source: str
    profile: str


@dataclass(kw_only=True, slots=True, frozen=True)
class MixEntry:
    """One dataset's share of a phase: an absolute `count` or a `ratio` of the phase total."""

    dataset: str
    count: int | None = None
    ratio: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Phase:
    """A curriculum phase: a seeded mix of datasets plus its training settings."""

    name: str
    description: str = ""
    mix: tuple[MixEntry, ...]
    total: int | None = None  # required when the mix uses ratios
    model: str
    init_from: str | None = None  # previous phase whose final weights this one starts from
    lr: float
    warmup_steps: int
    epochs: int
    max_steps: int | None = None  # caps the run (demo, smoke tests)
    cfg_dropout: float
    min_snr_gamma: float
    batch_size: int
    grad_accum: int = 1
    seed: int = 0
    sample_prompts: tuple[str, ...] = ()  # prompts of the sample grids; empty: the trainer's


@dataclass(kw_only=True, slots=True, frozen=True)
class Model:
    """The three networks and tokenizer of an SD1.x model.

    Each network is either `pretrained` (a local folder or Hugging Face repo id, loaded with
    `local_files_only` unless downloads are enabled) or built from `*_config` with random
    weights (the tiny twins used by tests and the demo).
    """

    name: str
    resolution: int  # image side in pixels; latents are resolution / 8
    scaling_factor: float = 0.18215
    unet_config: dict = field(default_factory=dict)
    unet_pretrained: str = ""
    vae_config: dict = field(default_factory=dict)
    vae_pretrained: str = ""
    text_config: dict = field(default_factory=dict)
    text_pretrained: str = ""
