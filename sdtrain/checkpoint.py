"""Checkpoints: whole folders swapped into place, a sha256 per file, no pickle; the keep policy.

`checkpoints/step-NNNNNN/` holds live + EMA weights (safetensors), the EMA's age (ema.json),
the trainer state as JSON with its tensors (optimizer moments) in optimizer.safetensors,
config and checksums.json (written last). Files are written side by side in threads, each
hashed and fsynced, and the folder is renamed into place, so a kill at any moment leaves the
previous checkpoint whole and pointed to by the `latest` / `best` links. Nothing here unpickles:
a run folder on shared storage cannot run code on the ranks that resume from it.
Policy as seed 002: rolling, periodic, best; plus the checkpoint an eval metric chose
(`best-by-<metric>`, pointed by `sdpipe eval --checkpoints`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from sdtrain.atomic import (
    TMP_MARK,
    atomic_path,
    clean_temporaries,
    fsync_path,
    replace_dir,
    write_json_atomic,
)
from sdtrain.config import TrainConfig

# Wrappers that prefix parameter names: DDP, torch.compile, pipelines, FSDP.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "unet.", "_fsdp_wrapped_module.")
CHECKSUMS = "checksums.json"
BEST_BY = "best-by-"  # link prefix: `best-by-clip_score` is the checkpoint that metric chose
EMA_FILE = "ema.json"  # {"ema_step": optimizer steps the EMA has averaged, across phases}
LINEAGE_FILE = "lineage.json"  # what the weights trained on: sdtrain.lineage


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


def check_finite(state: dict[str, torch.Tensor], what: str) -> None:
    """Refuse weights with a NaN or an infinity: such a checkpoint would poison every resume."""
    tensors = [t for t in state.values() if t.is_floating_point()]
    if not tensors:
        return
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    if not bool(torch.isfinite(norms).all()):
        names = [n for n, t in state.items() if t.is_floating_point()]
        bad = [names[i] for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist()]
        raise CheckpointError(
            f"refusing to write a checkpoint from non-finite {what} weights "
            f"({len(bad)} tensors, e.g. {bad[0]})"
        )


# ---- trainer state: JSON + safetensors -------------------------------------------------------


def encode_state(obj, tensors: dict[str, torch.Tensor], path: str = "s"):
    """`obj` as JSON-able data; its tensors moved into `tensors` under their path. Tuples,
    non-string keys and numpy arrays are tagged so `decode_state` rebuilds them exactly."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        items = [
            [encode_state(k, tensors), encode_state(v, tensors, f"{path}.{k}")]
            for k, v in obj.items()
        ]
        if all(isinstance(k, str) for k in obj):
            return {k: v for (k, _), (_, v) in zip(obj.items(), items, strict=True)}
        return {"__items__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"trainer state at {path}: cannot store a {type(obj).__name__}")


def decode_state(data, tensors: dict[str, torch.Tensor]):
    if isinstance(data, list):
        return [decode_state(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        return tensors[data["__tensor__"]]
    if "__ndarray__" in data:
        return np.array(data["__ndarray__"], dtype=data["dtype"])
    if "__tuple__" in data:
        return tuple(decode_state(v, tensors) for v in data["__tuple__"])
    if "__items__" in data:
        return {decode_state(k, tensors): decode_state(v, tensors) for k, v in data["__items__"]}
    return {k: decode_state(v, tensors) for k, v in data.items()}


# ---- writing and reading a checkpoint folder ---------------------------------------------------


def _write_file(path: Path, write) -> str:
    """Write one file with `write(path)`, flush it to disk; its sha256 (read back from cache)."""
    write(path)
    fsync_path(path)
    return _sha256(path)


def write_checkpoint(
    directory: Path,
    *,
    unet: dict[str, torch.Tensor],
    unet_ema: dict[str, torch.Tensor],
    config: TrainConfig,
    trainer: dict | None = None,
    ema_step: int = 0,
    extra: dict[str, dict[str, torch.Tensor]] | None = None,
    lineage: str | None = None,
) -> Path:
    """Write `directory` whole: built under a hidden temporary name, then swapped into place.

    `extra`: more weights files by name (a fine-tune's trained text encoder); `lineage`: the
    segments of the rows trained on (`sdtrain.lineage`), JSON. Refuses
    non-finite weights. The files are written concurrently (the large ones release
    the GIL): at SD1.5 size that is what a cancel has to fit in (docs/benchmarks.md).
    """
    check_finite(unet, "live")
    check_finite(unet_ema, "EMA")
    tmp = directory.with_name(f".{directory.name}{TMP_MARK}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    files = {
        "unet.safetensors": lambda p: save_file(cpu_state(unet), str(p)),
        "unet_ema.safetensors": lambda p: save_file(cpu_state(unet_ema), str(p)),
        "config.json": config.to_json,
        EMA_FILE: lambda p: p.write_text(json.dumps({"ema_step": ema_step})),
    }
    if lineage is not None:
        files[LINEAGE_FILE] = lambda p: p.write_text(lineage)
    for name, state in (extra or {}).items():
        check_finite(state, name)
        files[name] = lambda p, s=state: save_file(cpu_state(s), str(p))
    if trainer is not None:
        tensors: dict[str, torch.Tensor] = {}
        encoded = encode_state(trainer, tensors)
        # Moments in two files, so no one file (and thread) holds most of the bytes.
        halves = [dict(list(tensors.items())[i::2]) for i in (0, 1)]
        for i, half in enumerate(halves):
            files[f"optimizer-{i}.safetensors"] = lambda p, h=half: save_file(cpu_state(h), str(p))
        files["trainer.json"] = lambda p: p.write_text(json.dumps(encoded))
    with ThreadPoolExecutor(len(files)) as pool:
        digests = dict(
            zip(files, pool.map(lambda n: _write_file(tmp / n, files[n]), files), strict=True)
        )
    write_json_atomic(tmp / CHECKSUMS, dict(sorted(digests.items())))  # last: "complete"
    replace_dir(tmp, directory)
    return directory


def read_ema_step(directory: Path) -> int:
    """How many optimizer steps the EMA of a checkpoint or final/ folder has averaged (0 for
    folders written before sdpipe kept it)."""
    path = Path(directory) / EMA_FILE
    return int(json.loads(path.read_text())["ema_step"]) if path.is_file() else 0


def verify_checkpoint(directory: Path) -> None:
    """Raise CheckpointError unless every file matches the checksum recorded for it."""
    record = directory / CHECKSUMS
    if not record.is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint (no {CHECKSUMS})")
    try:
        recorded = json.loads(record.read_text())
    except ValueError:
        raise CheckpointError(f"{record}: unreadable") from None
    names = list(recorded)
    with ThreadPoolExecutor(max(1, min(8, len(names)))) as pool:
        digests = list(pool.map(lambda n: _sha256_or_none(directory / n), names))
    for name, digest in zip(names, digests, strict=True):
        if digest != recorded[name]:
            raise CheckpointError(
                f"{directory / name}: missing or corrupt (sha256 differs from {CHECKSUMS})"
            )


def read_trainer_state(directory: Path, device: torch.device) -> dict:
    """The trainer state of a verified checkpoint. No pickle is loaded: JSON + safetensors, or
    (checkpoints of older sdpipe versions) trainer.pt through `torch.load(weights_only=True)`."""
    verify_checkpoint(directory)
    if (directory / "trainer.json").is_file():
        tensors: dict[str, torch.Tensor] = {}
        for part in sorted(directory.glob("optimizer-*.safetensors")):
            tensors |= load_file(str(part), device=str(device))
        return decode_state(json.loads((directory / "trainer.json").read_text()), tensors)
    legacy = directory / "trainer.pt"
    try:
        with torch.serialization.safe_globals(_NUMPY_STATE_GLOBALS):
            return torch.load(legacy, map_location=device, weights_only=True)
    except Exception as e:  # an unpickling refusal, whatever class torch raises it as
        raise CheckpointError(
            f"{legacy}: not loaded (only plain tensors and data are): {e}"
        ) from None


# What a set re-mixed since (rows taken out by a removal) may change under a resume.
REMIX_KEYS = ("manifest_sha256", "num_train_rows", "total_steps", "batches_per_epoch")


def check_resumable(
    state: dict,
    run_shape: dict,
    *,
    bucketed: bool,
    resume_from: Path,
    manifest: Path,
    remixed: bool = False,
) -> None:
    """Fails, saying what to do, unless the checkpoint's run had this run's shape (steps,
    global batch, rows, seed, objective, the phase set's `manifest` digest) and read its set the
    same way (epoch sampler or batches of one bucket). `remixed`: the set may have been re-mixed
    (`REMIX_KEYS` may differ; the run goes on from the same epoch position, a new lineage
    segment)."""
    for key, value in run_shape.items():
        if key not in state["run_shape"] or (remixed and key in REMIX_KEYS):
            continue
        if key == "manifest_sha256" and state["run_shape"][key] != value:
            raise CheckpointError(
                f"{resume_from} was trained on another phase set: "
                f"{manifest} changed since (sha256 "
                f"{state['run_shape'][key][:12]} -> {value[:12]}); restore that phase set "
                "to resume, or delete the run's checkpoints/ to train the phase from the start"
            )
        if state["run_shape"][key] != value:
            raise CheckpointError(
                f"{resume_from}: written by a run with {key}={state['run_shape'][key]!r}, "
                f"this run has {value!r}; resume with the same settings or use a new run_dir"
            )
    was_bucketed = state.get("batches_done") is not None  # older checkpoints: never
    if was_bucketed != bucketed:
        orders = ("in the epoch sampler's order", "in batches of one bucket")
        raise CheckpointError(
            f"{resume_from}: written by a run that read its phase set "
            f"{orders[was_bucketed]}, this run reads it {orders[bucketed]} (flip_p, "
            "sample_latents, train_time_captions or the set's buckets changed); resume "
            "with the same settings or use a new run_dir"
        )


# numpy's RNG state in trainer.pt files of older versions: data, not code.
_NUMPY_STATE_GLOBALS = [
    np._core.multiarray._reconstruct,
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _sha256_or_none(path: Path) -> str | None:
    return _sha256(path) if path.is_file() else None


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

    def to_keep(
        self,
        steps: list[int],
        *,
        latest: int,
        best: int | None,
        best_by_metric: set[int] = frozenset(),
    ) -> set[int]:
        """`best_by_metric`: steps an eval metric chose (kept as long as a link names them)."""
        periodic = {s for s in steps if self.keep_every > 0 and s % self.keep_every == 0}
        return periodic | {latest} | ({best} if best is not None else set()) | best_by_metric


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

    def best(self, metric: str | None = None) -> Path | None:
        """The best checkpoint by validation loss, or by an eval `metric` once one chose."""
        return self._resolve("best" if metric is None else BEST_BY + metric)

    def resume_point(self) -> Path | None:
        """The checkpoint to resume from: `latest`, or if it is corrupt or missing while step
        folders exist, the newest one that verifies (with a warning naming what was skipped)."""
        latest = self.latest()
        candidates = [latest] if latest else []
        candidates += [self.step_dir(s) for s in reversed(self.steps())]
        skipped = []
        for directory in dict.fromkeys(candidates):  # in order, without repeats
            try:
                verify_checkpoint(directory)
            except CheckpointError as e:
                skipped.append(str(e))
                continue
            if skipped:
                print(
                    f"warning: resuming from {directory.name}, not the newer checkpoint(s) that "
                    f"fail verification: {'; '.join(skipped)}",
                    flush=True,
                )
            return directory
        if skipped:
            raise CheckpointError(f"no checkpoint verifies: {'; '.join(skipped)}")
        return None

    def save(self, step: int, *, is_best: bool = False, **contents) -> Path:
        """Write the checkpoint of `step`, point `latest` (and `best`) at it, prune the rest."""
        directory = write_checkpoint(self.step_dir(step), **contents)
        self._link("latest", directory)
        if is_best:
            self._link("best", directory)
        self.prune()
        return directory

    def point_best(self, step: int, metric: str | None = None) -> None:
        """Point `best` (validation loss) or `best-by-<metric>` at a step's checkpoint."""
        self._link("best" if metric is None else BEST_BY + metric, self.step_dir(step))
        self.prune()

    def prune(self) -> None:
        latest, best = self.latest(), self.best()
        chosen = [self._resolve(p.name) for p in self.root.glob(BEST_BY + "*")]
        keep = self.policy.to_keep(
            self.steps(),
            latest=int(latest.name[5:]) if latest else -1,
            best=int(best.name[5:]) if best else None,
            best_by_metric={int(p.name[5:]) for p in chosen if p is not None},
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
