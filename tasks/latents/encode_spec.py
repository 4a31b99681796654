"""A source's latent spec, and whether a shard is encoded under it.

`LatentSpec` (VAE, bucket plan, views, channels: docs/training-data.md, "Latents on disk") decides
the files encode writes; a shard is done only under the spec it was encoded with, and a shard
encoded under another spec is forgotten before it is encoded again."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from catalog import Model
from catalog.buckets import BucketPlan
from tasks.latents import kept_latents, latent_keys
from tasks.runtime.shards import ShardStats, done_record, stats_path

STAGE = "latents"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LatentSpec:
    """What a source's latents are encoded under: the VAE (`vae_identity`), the bucket plan,
    views (1, or 2 with the mirrored image) and channels (4: the scaled mean; 8: and its
    log-variance). Portable: no path, host or mtime, so a copied data root is done elsewhere.
    `legacy`: the model's one square, 1 view, 4 channels (today's `NNNNN.npy` layout)."""

    vae: dict
    plan: BucketPlan
    views: int = 1
    channels: int = 4
    legacy: bool = True

    @classmethod
    def of(cls, model: Model, *, flips: bool = False, sampling: bool = False) -> LatentSpec:
        plan = BucketPlan.from_dict(model.buckets, model.resolution)
        views, channels = (2 if flips else 1), (8 if sampling else 4)
        square = plan.is_square and plan.sizes()[0].tolist() == [model.resolution] * 2
        return cls(
            vae=vae_identity(model),
            plan=plan,
            views=views,
            channels=channels,
            legacy=square and views == 1 and channels == 4,
        )

    def to_dict(self) -> dict:
        plan = self.plan.to_dict()
        plan["max_aspect"] = float(plan["max_aspect"])  # 2 and 2.0 are one plan
        return {"vae": self.vae, "plan": plan, "views": self.views, "channels": self.channels}

    def digest(self) -> str:
        """A short digest of `to_dict()`: part of the encode task's cache key."""
        return kept_latents.spec_digest(self.to_dict())

    def __hash__(self) -> int:  # `vae` is a dict
        return hash(self.digest())


def vae_identity(model: Model) -> dict:
    """The VAE a latent was made by: the model's name, its pretrained weights as the catalog
    names them (a repo id or folder) or a digest of its config, and the scaling factor."""
    weights = model.vae_pretrained or (
        "config-sha256:"
        + hashlib.sha256(json.dumps(model.vae_config, sort_keys=True).encode()).hexdigest()[:16]
    )
    return {"model": model.name, "weights": weights, "scaling_factor": model.scaling_factor}


def shard_done(root: Path, source: str, shard: str, spec: LatentSpec) -> bool:
    """The shard's record is there, its outputs intact (`done_record`), and it was encoded under
    `spec`: a shard encoded under another spec is not done."""
    record = done_record(root, source, STAGE, shard)
    return record is not None and _encoded_under(record, spec)


def _encoded_under(record: ShardStats, spec: LatentSpec) -> bool:
    recorded = record.extra.get("latent_spec")
    if recorded is None:  # written before specs were recorded: the legacy layout
        return spec.legacy
    if recorded != spec.to_dict():
        return False
    if spec.legacy:
        return True
    # The keys file and every bucket file it names: among the outputs `done_record` checked.
    named = [f"{record.shard}{latent_keys.SUFFIX}"]
    named += [f"{record.shard}.{b}.npy" for b in record.extra.get("buckets", {})]
    return all(n in record.outputs for n in named)


def forget_other_spec(
    root: Path,
    source: str,
    shard: str,
    spec: LatentSpec,
    links: kept_latents.PhaseLinks | None = None,
) -> bool:
    """True if the shard is done under `spec`. Otherwise it is encoded again: its files that
    phase sets link are first kept aside (`kept_latents.keep_linked`, under the spec they were
    encoded under; `links`: the data root's phase-set links, default `phase_links(root)`), and
    a record of another spec is removed (with a warning). A shard with no record may still hold
    an earlier encode's files (a refetch or re-selection removed its record): kept the same way.
    """
    record = done_record(root, source, STAGE, shard)
    if record is not None and _encoded_under(record, spec):
        return True
    links = links or kept_latents.phase_links(root)
    if record is None:
        kept_latents.keep_linked(root, source, shard, links)
        return False
    log.warning("encode %s/%s: encoded under another latent spec; encoding it again", source, shard)
    kept_latents.keep_linked(root, source, shard, links, record.extra.get("latent_spec"))
    stats_path(root, source, STAGE, shard).unlink(missing_ok=True)
    return False
