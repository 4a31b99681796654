"""Checkpoints: whole folders renamed into place with a sha256 per file, and their keep policy.

`checkpoints/step-NNNNNN/` holds live + EMA weights, trainer state, config and checksums.json
(written last); `latest` and `best` are symlinks replaced atomically, so a kill at any moment
leaves the previous checkpoint whole and pointed to. Policy as seed 002: rolling, periodic, best.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sdtrain.config import TrainConfig
from tasks.shards import TMP_MARK, atomic_path, clean_temporaries, write_json_atomic

# Wrappers that prefix parameter names: DDP, torch.compile, pipelines, FSDP.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "unet.", "_fsdp_wrapped_module.")
CHECKSUMS = "checksums.json"


class CheckpointError(Exception):
    """A checkpoint is incomplete, corrupt, or was written by an incompatible run."""


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter names without wrapper prefixes, e.g. `module._orig_mod.conv_in.weight`."""
    out = {}
    for key, value in state.items():
        key = key.replace("._fsdp_wrapped_module.", ".")
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A UNet state dict from a .safetensors or torch file, wrapper prefixes stripped."""
    path = Path(path)
    if path.suffix == ".safetensors":
        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return strip_prefixes(state)


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def write_checkpoint(
    directory: Path,
    *,
    unet: dict[str, torch.Tensor],
    unet_ema: dict[str, torch.Tensor],
    config: TrainConfig,
    trainer: dict | None = None,
) -> Path:
    """Write `directory` whole: built under a hidden temporary name, then renamed into place."""
    tmp = directory.with_name(f".{directory.name}{TMP_MARK}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(cpu_state(unet), str(tmp / "unet.safetensors"))
    save_file(cpu_state(unet_ema), str(tmp / "unet_ema.safetensors"))
    config.to_json(tmp / "config.json")
    if trainer is not None:
        torch.save(trainer, tmp / "trainer.pt")
    checksums = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    write_json_atomic(tmp / CHECKSUMS, checksums)  # last: its presence means "complete"
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def verify_checkpoint(directory: Path) -> None:
    """Raise CheckpointError unless every file matches the checksum recorded for it."""
    record = directory / CHECKSUMS
    if not record.is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint (no {CHECKSUMS})")
    for name, digest in json.loads(record.read_text()).items():
        path = directory / name
        if not path.is_file() or _sha256(path) != digest:
            raise CheckpointError(f"{path}: missing or corrupt (sha256 differs from {CHECKSUMS})")


def read_trainer_state(directory: Path, device: torch.device) -> dict:
    verify_checkpoint(directory)
    return torch.load(directory / "trainer.pt", map_location=device, weights_only=False)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(kw_only=True, slots=True, frozen=True)
class KeepPolicy:
    checkpoint_every: int  # a rolling `latest`; 0: only at the end and when interrupted
    keep_every: int  # steps whose checkpoint is kept for good; 0: none

    def due(self, step: int, total_steps: int) -> bool:
        return (
            step == total_steps
            or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0)
            or (self.keep_every > 0 and step % self.keep_every == 0)
        )

    def to_keep(self, steps: list[int], *, latest: int, best: int | None) -> set[int]:
        periodic = {s for s in steps if self.keep_every > 0 and s % self.keep_every == 0}
        return periodic | {latest} | ({best} if best is not None else set())


class CheckpointDir:
    """`<run_dir>/checkpoints/`: step folders, the `latest` and `best` links, pruning."""

    def __init__(self, root: Path, policy: KeepPolicy):
        self.root = root
        self.policy = policy

    def clean(self) -> None:
        clean_temporaries(self.root)  # half-written folders and links of a killed run

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[5:]) for p in self.root.glob("step-*") if p.is_dir())

    def latest(self) -> Path | None:
        return self._resolve("latest")

    def best(self) -> Path | None:
        return self._resolve("best")

    def save(self, step: int, *, is_best: bool = False, **contents) -> Path:
        """Write the checkpoint of `step`, point `latest` (and `best`) at it, prune the rest."""
        directory = write_checkpoint(self.step_dir(step), **contents)
        self._link("latest", directory)
        if is_best:
            self._link("best", directory)
        self.prune()
        return directory

    def point_best(self, step: int) -> None:
        self._link("best", self.step_dir(step))
        self.prune()

    def prune(self) -> None:
        latest, best = self.latest(), self.best()
        keep = self.policy.to_keep(
            self.steps(),
            latest=int(latest.name[5:]) if latest else -1,
            best=int(best.name[5:]) if best else None,
        )
        for step in self.steps():
            if step not in keep:
                shutil.rmtree(self.step_dir(step))

    def _resolve(self, name: str) -> Path | None:
        link = self.root / name
        return link.resolve() if link.is_symlink() and link.exists() else None

    def _link(self, name: str, target: Path) -> None:
        with atomic_path(self.root / name) as tmp:
            os.symlink(target.name, tmp)  # relative: the run folder can move
