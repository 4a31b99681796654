"""The catalogs benches run on: a copy of the packaged catalog in the bench's work folder, made
this process's catalog (`SDPIPE_CATALOG`) before anything loads it, with the demo source resized
or a `bench` model added (the tiny twin, or SD1.5's architecture with random weights).
"""

from __future__ import annotations

import os
from pathlib import Path

from catalog.architectures import CLIP_L_TEXT_CONFIG, SD_VAE_CONFIG
from catalog.copies import copy_catalog, edit_entries


def use_copy(work: Path) -> Path:
    """A copy of the packaged catalog at `work/catalog`, this process's catalog from now on."""
    catalog = copy_catalog(work / "catalog")
    os.environ["SDPIPE_CATALOG"] = str(catalog)
    return catalog


def demo_catalog(work: Path, num_images: int, samples_per_shard: int | None = None) -> Path:
    """`use_copy` with a demo source of `num_images` scenes (and `samples_per_shard`)."""
    catalog = use_copy(work)
    with edit_entries(catalog / "sources.yaml") as sources:
        sources["demo"]["options"]["num_images"] = num_images
        if samples_per_shard is not None:
            sources["demo"]["samples_per_shard"] = samples_per_shard
    return catalog


def bench_model(models: dict, full: bool) -> dict:
    """The catalog entry of the `bench` model: SD1.5 at full size with random weights (its VAE
    and text encoder built from their architectures in place of their pretrained weights: speed
    does not depend on the values, and there are no downloads), else the tiny twin."""
    if not full:
        return dict(models["tiny"])
    entry = models["sd15"] | {
        "vae_config": SD_VAE_CONFIG | {"sample_size": 512},
        "text_config": CLIP_L_TEXT_CONFIG,
    }
    del entry["vae_pretrained"], entry["text_pretrained"]
    return entry
