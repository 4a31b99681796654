"""A fine-tune's data: its images -> cached latents (+ pixels, captions), class images made by
the base model, all in `<root>/finetunes/<name>/data/`, the folder the trainer reads.

Images pass the encode stage's rules (tasks/latents/images.py), each dropped one counted under its
reason, and are encoded once by the same VAE path (seed 000 caches latents the same way).
The folder is swapped in whole and rebuilt only when its inputs change; a lock per fine-tune
serializes preparation, so the runs of a sweep share one set of class images and latents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from catalog import Finetune, load_catalog
from sdtrain.atomic import TMP_MARK, replace_dir, write_json_atomic
from sdtrain.config import FinetuneSettings, TrainConfig, run_config
from sdtrain.models import build_tokenizer, tokenize
from sdtrain.weights import WeightsNotFound, is_diffusers_folder, resolve_weights
from tasks.latents import images

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
DATA = "data"
CLASS_IMAGES = "class-images"


class FinetuneError(Exception):
    """Bad input to a fine-tune; the message is one line naming the item and the reason."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Base:
    """The weights a fine-tune starts from and makes its class images with."""

    folder: Path  # a run's final/ (or a checkpoint folder), or a diffusers pipeline folder
    model: str  # catalog model, or the diffusers folder itself
    unet_file: str  # the UNet weights to start from; "": the model's own (diffusers folder)
    prediction_type: str
    negative_prompt: str


def finetune_dir(root: Path, name: str) -> Path:
    return root / "finetunes" / name


def run_dir(root: Path, name: str, run_name: str) -> Path:
    return finetune_dir(root, name) / "runs" / run_name


def in_root(path: str | Path, root: Path) -> Path:
    """Catalog and deployment paths are under the data root unless absolute."""
    return root / Path(path)


def resolve_base(base: str, root: Path) -> Base:
    """A phase or run name under `<root>/runs/` (its final/), a weights folder, or a diffusers
    pipeline folder; a missing one fails in one line naming it."""
    path = Path(base)
    if not (path.is_absolute() or len(path.parts) > 1):
        final = root / "runs" / base / "final"
        if not (final / "unet_ema.safetensors").is_file():
            raise FinetuneError(
                f"base {base!r}: no final weights at {final}; train it first "
                "(curriculum/<phase>) or give a weights or diffusers folder"
            )
        path = final
    else:
        path = in_root(path, root)
        if not path.exists():
            raise FinetuneError(f"base {base!r}: {path} does not exist")
    if is_diffusers_folder(path):
        scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        return Base(
            folder=path,
            model=str(path),
            unet_file="",
            prediction_type=scheduler.get("prediction_type", "epsilon"),
            negative_prompt="",
        )
    try:
        folder = resolve_weights(path)
    except WeightsNotFound as e:
        raise FinetuneError(f"base {base!r}: {e}") from None
    config = TrainConfig.from_json(folder / "config.json")
    if config.finetune is not None:
        raise FinetuneError(f"base {base!r}: {folder} is a fine-tune; start from its base")
    return Base(
        folder=folder,
        model=config.model,
        unet_file=str(folder / "unet_ema.safetensors"),
        prediction_type=config.prediction_type,
        negative_prompt=config.negative_prompt,
    )


def prompts(spec: Finetune) -> tuple[str, str]:
    """(instance prompt, class prompt) with the token and class noun filled in."""
    fill = {"token": spec.token, "class_noun": spec.class_noun}
    return spec.instance_prompt.format(**fill), spec.class_prompt.format(**fill)


def token_warning(token: str) -> str | None:
    """A warning when the tokenizer cuts the unique token into pieces: the subject then binds
    to several common sub-words instead of one rare token."""
    pieces = build_tokenizer().tokenize(token)
    if len(pieces) <= 1:
        return None
    return (
        f"unique token {token!r} is {len(pieces)} CLIP tokens ({' '.join(pieces)}), not one: "
        "the subject binds to sub-words that other prompts use; a rare single token "
        "(e.g. 'sks') binds it alone"
    )


def image_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise FinetuneError(f"images folder {folder}: does not exist")
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
    )
    if not files:
        raise FinetuneError(
            f"images folder {folder}: no images (files ending in {', '.join(IMAGE_SUFFIXES)})"
        )
    return files


def conversion(data: bytes) -> str | None:
    """What the image rules convert in this image, for the record: cmyk, alpha, grayscale,
    16bit (the header says; nothing is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            mode, info = image.mode, image.info
    except Exception:
        return None
    if mode == "CMYK":
        return "cmyk"
    if mode in ("RGBA", "LA", "PA") or "transparency" in info:
        return "alpha"
    if mode.startswith("I;16") or mode == "I":
        return "16bit"
    if mode in ("L", "1"):
        return "grayscale"
    return None


@dataclass(kw_only=True, slots=True)
class Decoded:
    names: list[str]
    pixels: np.ndarray  # uint8 [N, size, size, 3]
    dropped: Counter
    converted: Counter
    notes: list[str]  # one line per dropped image: "name: reason"


def decode_folder(files: Sequence[Path], size: int, *, min_side: int) -> Decoded:
    """The images by the encode stage's rules, `too_small` under `min_side` (stored pixels)."""
    names, kept = [], []
    dropped, converted, notes = Counter(), Counter(), []
    for path in files:
        data = path.read_bytes()
        try:
            dims = images.header_size(data, images.sniff(data))
            if dims and min(dims) < min_side:
                raise images.Unusable("too_small")
            rgb = images.decode_rgb(data, size)
            if not dims and min(rgb.shape[:2]) < min_side:
                raise images.Unusable("too_small")
            kept.append(images.fit(rgb, size))
        except images.Unusable as e:
            dropped[e.reason] += 1
            notes.append(f"{path.name}: dropped, {e.reason}")
            continue
        except cv2.error:
            dropped["decode_error"] += 1
            notes.append(f"{path.name}: dropped, decode_error")
            continue
        names.append(path.name)
        if kind := conversion(data):
            converted[kind] += 1
    pixels = np.stack(kept) if kept else np.zeros((0, size, size, 3), np.uint8)
    return Decoded(names=names, pixels=pixels, dropped=dropped, converted=converted, notes=notes)


def encode_latents(model_name: str, pixels: np.ndarray, device: torch.device) -> np.ndarray:
    """fp16 latents [N, 4, h, w] of uint8 pixels by the encode stage's VAE path."""
    from tasks.latents.encode import encode_images, vae_for

    model = load_catalog().model(model_name)
    vae = vae_for(model, device)
    parts = [
        encode_images(vae, pixels[i : i + 16], model.scaling_factor)
        for i in range(0, len(pixels), 16)
    ]
    return np.concatenate(parts) if parts else np.zeros((0, 4, 0, 0), np.float16)


@contextlib.contextmanager
def prepare_lock(folder: Path) -> Iterator[None]:
    """One preparation per fine-tune at a time; a second (a sweep's other run) waits for it,
    then finds everything made."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".prepare.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _file_ids(files: Sequence[Path]) -> list:
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def make_class_images(
    spec: Finetune, base: Base, folder: Path, devices: Sequence[torch.device]
) -> list[Path]:
    """`num_class_images` images of the class prompt by the base model (EMA, its negative
    prompt), made by the batch generator: those already there are reused."""
    from tasks.generation.generate import Settings, generate_images

    _, class_prompt = prompts(spec)
    index = generate_images(
        base.folder,
        [class_prompt],
        list(range(spec.num_class_images)),
        folder,
        devices=list(devices),
        settings=Settings(num_steps=spec.class_steps),
    )
    return [folder / name for name in index["file"].to_pylist()]


def prepare(
    root: Path,
    spec: Finetune,
    base: Base,
    *,
    devices: Sequence[torch.device],
    on_line: Callable[[str], None] = print,
) -> dict:
    """Make (or reuse) the fine-tune's data folder; returns its stats record."""
    fdir = finetune_dir(root, spec.name)
    model = load_catalog().model(base.model)
    size = model.resolution
    min_side = spec.min_side if spec.min_side is not None else size // 2
    with prepare_lock(fdir):
        files = image_files(in_root(spec.images, root))
        class_files: list[Path] = []
        if spec.mode == "dreambooth" and spec.prior_preservation:
            on_line(f"class images: {spec.num_class_images} of {prompts(spec)[1]!r}")
            class_files = make_class_images(spec, base, fdir / CLASS_IMAGES, devices)
        captions = [_caption(spec, f) for f in files]
        inputs = {
            "files": _file_ids(files),
            "captions": captions,
            "class_files": [p.name for p in class_files],
            "model": base.model,
            "size": size,
            "min_side": min_side,
            "flip": spec.flip,
            "mode": spec.mode,
        }
        data = fdir / DATA
        stats_file = data / "stats.json"
        if stats_file.is_file():
            stats = json.loads(stats_file.read_text())
            if stats.get("inputs_sha256") == _digest(inputs):
                on_line(f"data: reused {data} ({stats['num_instance']} images)")
                return stats
        stats = _build(
            data, spec, model.name, files, captions, class_files, size, min_side, devices
        )
        stats["inputs_sha256"] = _digest(inputs)
        write_json_atomic(data / "stats.json", stats)
        for note in stats["notes"]:
            on_line(note)
        on_line(
            f"data: {stats['num_instance']} images kept of {len(files)}"
            + "".join(f", {r}={n}" for r, n in sorted(stats["dropped"].items()))
            + f"; {stats['num_class']} class images; {data}"
        )
        return stats


def _caption(spec: Finetune, image: Path) -> str:
    """DreamBooth: the instance prompt. Inpainting: the `.txt` beside the image, else the
    entry's `prompt` (the 4-channel mode ignores captions)."""
    if spec.mode == "dreambooth":
        return prompts(spec)[0]
    text = image.with_suffix(".txt")
    return text.read_text(encoding="utf-8").strip() if text.is_file() else spec.prompt


def _build(data, spec, model_name, files, captions, class_files, size, min_side, devices):
    instance = decode_folder(files, size, min_side=min_side)
    if not instance.names:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(instance.dropped.items()))
        raise FinetuneError(f"images folder {files[0].parent}: no usable images ({reasons})")
    by_name = dict(zip([f.name for f in files], captions, strict=True))
    names, pixels = list(instance.names), instance.pixels
    texts = [by_name[n] for n in names]
    if spec.flip:  # mirrored copies, encoded once like the originals (kohya's flip_aug)
        names += [f"{n}#flip" for n in instance.names]
        pixels = np.concatenate([pixels, pixels[:, :, ::-1]])
        texts += texts
    kinds = ["instance"] * len(names)
    classes = decode_folder(class_files, size, min_side=0)
    if class_files and len(classes.names) != len(class_files):
        raise FinetuneError(f"class images in {class_files[0].parent}: {classes.notes[0]}")
    names += classes.names
    kinds += ["class"] * len(classes.names)
    texts += [prompts(spec)[1]] * len(classes.names)
    pixels = np.ascontiguousarray(np.concatenate([pixels, classes.pixels]))
    latents = encode_latents(model_name, pixels, devices[0])
    ids = tokenize(texts).to(torch.int32).numpy()
    manifest = pa.table(
        {
            "key": names,
            "kind": kinds,
            "caption": texts,
            "input_ids": pa.array(ids.tolist(), pa.list_(pa.int32())),
        }
    )
    tmp = data.with_name(f".{data.name}{TMP_MARK}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    pq.write_table(manifest, tmp / "manifest.parquet")
    np.save(tmp / "latents.npy", latents)
    if spec.mode == "inpaint":
        np.save(tmp / "pixels.npy", pixels)
    replace_dir(tmp, data)
    return {
        "num_instance": kinds.count("instance"),
        "num_class": kinds.count("class"),
        "dropped": dict(instance.dropped),
        "converted": dict(instance.converted),
        "notes": instance.notes,
    }


def settings_for(spec: Finetune, base: Base) -> FinetuneSettings:
    return FinetuneSettings(
        mode=spec.mode,
        base_unet=base.unet_file,
        prior_loss_weight=spec.prior_loss_weight if spec.prior_preservation else 0.0,
        train_text_encoder=spec.train_text_encoder,
        inpaint_channels=spec.inpaint_channels,
        lora_rank=spec.lora_rank,
        lora_alpha=float(spec.lora_alpha if spec.lora_alpha is not None else spec.lora_rank),
        num_demo_images=spec.num_demo_images,
    )


def train_config(root: Path, spec: Finetune, base: Base, run_name: str) -> TrainConfig:
    """The run config of a fine-tune: seed 001's optimizer settings unless the entry says."""
    instance_prompt, class_prompt = prompts(spec)
    sample_prompts = spec.sample_prompts or (
        (instance_prompt, class_prompt) if spec.mode == "dreambooth" else (spec.prompt,)
    )
    return run_config(
        spec,
        name=f"{spec.name}/{run_name}",
        phase_dir=finetune_dir(root, spec.name) / DATA,
        run_dir=run_dir(root, spec.name, run_name),
        model=base.model,
        prediction_type=base.prediction_type,
        sample_prompts=tuple(sample_prompts),
        negative_prompt=base.negative_prompt,
        finetune=settings_for(spec, base),
    )


def with_overrides(spec: Finetune, overrides: dict) -> Finetune:
    """The entry with a run's settings (a sweep's value), checked as the catalog checks it."""
    from catalog.loader import check_finetune, coerce_field

    values = {k: coerce_field(Finetune, k, v, f"{spec.name}.{k}") for k, v in overrides.items()}
    changed = dataclasses.replace(spec, **values)
    check_finetune(changed, Path("finetunes.yaml"))
    return changed
