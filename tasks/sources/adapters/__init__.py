"""Source adapters: one per upstream layout of archive and folder sources (see `base`)."""

from __future__ import annotations

import importlib

from catalog import FilterProfile, Source
from tasks.sources.adapters.base import (
    ALL,
    Adapter,
    SourceLayoutError,
    index_source,
    repack_shard,
    shard_names,
)

__all__ = [
    "ALL",
    "Adapter",
    "SourceLayoutError",
    "adapter_for",
    "index_source",
    "repack_shard",
    "shard_names",
]

# adapter name -> "module:class"; modules import on use (some need heavier libraries).
ADAPTERS = {
    "local": "tasks.sources.adapters.local:LocalFolder",
    "diffusiondb": "tasks.sources.adapters.diffusiondb:DiffusionDB",
    "journeydb": "tasks.sources.adapters.journeydb:JourneyDB",
    "vggface2": "tasks.sources.adapters.vggface2:VGGFace2",
    "coco": "tasks.sources.adapters.coco:Coco",
}


def adapter_name(source: Source) -> str:
    return source.adapter or source.name


def adapter_for(source: Source, profile: FilterProfile) -> Adapter:
    name = adapter_name(source)
    if name not in ADAPTERS:
        raise SourceLayoutError(
            f"source {source.name!r}: no adapter {name!r} for kind {source.kind!r} "
            f"(set `adapter:` to one of {', '.join(sorted(ADAPTERS))})"
        )
    module, _, cls = ADAPTERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(source, profile)
