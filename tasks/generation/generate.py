"""Batch generation: prompts x seeds -> PNG files + `index.parquet`, resumable, on many devices.

A file's name is its prompt's index, its seed and a digest of all else the image depends on
(prompt, negative, steps, CFG, the weights' sha256), so a file there is exactly the image asked
for: a rerun skips it, and new settings make new files. Each image draws noise from its own seed:
it is the same whichever batch, chunk or device makes it (and as `sdpipe sample` makes it).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from PIL import PngImagePlugin

from catalog import load_catalog
from sdtrain.atomic import atomic_path, clean_temporaries
from sdtrain.config import TrainConfig
from sdtrain.sampling import generate, pick_device
from sdtrain.weights import WeightsNotFound, is_diffusers_folder, load_networks, resolve_weights

INDEX = "index.parquet"
PARTS = ".parts"  # per-chunk records: which device made which files, and how fast
LOCK = ".lock"


class GenerateError(Exception):
    """Bad input to a batch (prompts, seeds, folder); the message is one line naming it."""


class GenerateFailed(Exception):
    """Some images were not made (a worker died); the others are kept and a rerun makes the rest."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    num_steps: int = 100
    guidance_scale: float = 7.5
    negative_prompt: str | None = None  # None: the run's own, which its sample grids used


DEFAULT_SETTINGS = Settings()


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt with its own settings (e.g. a per-category CFG); None: the batch's."""

    text: str
    settings: Settings | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Weights:
    """A resolved weights folder and what identifies the images it makes."""

    folder: Path
    use_ema: bool
    sha256: str  # of the UNet file used
    model: str  # catalog model: the VAE and text encoder
    resolution: int
    negative_prompt: str  # the run's default


@dataclass(frozen=True, kw_only=True, slots=True)
class Item:
    """One image to make."""

    prompt_index: int
    prompt: str
    seed: int
    num_steps: int
    guidance_scale: float
    negative_prompt: str
    file: str  # name in the output folder

    @property
    def settings_key(self) -> tuple:
        return (self.num_steps, self.guidance_scale, self.negative_prompt)


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with `#` are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise GenerateError(f"{path}: no such prompt file") from None
    except UnicodeDecodeError as e:
        raise GenerateError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    prompts = [line.strip() for line in lines]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise GenerateError(
            f"{path}: no prompts (one per line; blank lines and # comments are skipped)"
        )
    return prompts


def find_weights(weights: str | Path, root: Path) -> Path:
    """A weights folder (see `resolve_weights`) or the name of a run under `<root>/runs/`."""
    path = Path(weights)
    if path.exists() or path.is_absolute() or len(path.parts) > 1:
        return resolve_weights(path)
    try:
        return resolve_weights(root / "runs" / path)
    except WeightsNotFound:
        raise WeightsNotFound(
            f"{weights}: neither a weights folder nor a run under {root / 'runs'}"
        ) from None


def open_weights(weights: str | Path, *, use_ema: bool = True) -> Weights:
    folder = resolve_weights(weights)
    if is_diffusers_folder(folder):  # e.g. an export, or a fine-tune's diffusers base
        model, negative_prompt = str(folder), ""
        unet_file = next(
            str(p.relative_to(folder)) for p in (folder / "unet").glob("*.safetensors")
        )
    else:
        config = TrainConfig.from_json(folder / "config.json")
        model, negative_prompt = config.model, config.negative_prompt
        unet_file = f"unet{'_ema' if use_ema else ''}.safetensors"
    checksums = folder / "checksums.json"
    recorded = json.loads(checksums.read_text()) if checksums.is_file() else {}
    if unet_file not in recorded:  # a folder of an older sdpipe: hash it once here
        with open(folder / unet_file, "rb") as f:
            recorded[unet_file] = hashlib.file_digest(f, "sha256").hexdigest()
    return Weights(
        folder=folder,
        use_ema=use_ema,
        sha256=recorded[unet_file],
        model=model,
        resolution=load_catalog().model(model).resolution,
        negative_prompt=negative_prompt,
    )


def plan(
    weights: Weights,
    prompts: Sequence[str | Prompt],
    seeds: Sequence[int],
    settings: Settings = DEFAULT_SETTINGS,
) -> list[Item]:
    """Every (prompt, seed) of the batch, prompt-major, with its file name."""
    if not prompts:
        raise GenerateError("no prompts")
    if not seeds or len(set(seeds)) != len(seeds):
        raise GenerateError(f"seeds must be distinct and at least one: {list(seeds)[:8]}")
    items = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt = Prompt(prompt)
        s = prompt.settings or settings
        negative = weights.negative_prompt if s.negative_prompt is None else s.negative_prompt
        what = [prompt.text, negative, s.num_steps, float(s.guidance_scale)]
        what += [weights.sha256, weights.use_ema, weights.model]
        digest = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:8]
        for seed in seeds:
            items.append(
                Item(
                    prompt_index=i,
                    prompt=prompt.text,
                    seed=int(seed),
                    num_steps=s.num_steps,
                    guidance_scale=float(s.guidance_scale),
                    negative_prompt=negative,
                    file=f"{i:05d}-{int(seed)}-{digest}.png",
                )
            )
    return items


def make_chunks(items: Sequence[Item], batch_size: int) -> list[list[Item]]:
    """Batches of at most `batch_size` images that share their settings, in plan order."""
    groups: dict[tuple, list[Item]] = {}
    for item in items:
        groups.setdefault(item.settings_key, []).append(item)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def assign(chunks: Sequence[list[Item]], num_workers: int) -> list[list[list[Item]]]:
    """Chunks dealt to workers in order, each to the least loaded (images x steps) so far."""
    loads, parts = [0] * num_workers, [[] for _ in range(num_workers)]
    for chunk in chunks:
        w = loads.index(min(loads))
        parts[w].append(chunk)
        loads[w] += len(chunk) * chunk[0].num_steps
    return parts


def parameters_text(item: Item, weights: Weights) -> str:
    """The generation settings as the `parameters` PNG text that A1111-style tools read."""
    return (
        f"{item.prompt}\nNegative prompt: {item.negative_prompt}\nSteps: {item.num_steps}, "
        f"Sampler: DDIM, CFG scale: {item.guidance_scale}, Seed: {item.seed}, "
        f"Size: {weights.resolution}x{weights.resolution}, Model hash: {weights.sha256[:10]}, "
        f"Weights: {'EMA' if weights.use_ema else 'live'}"
    )


class DeviceWorker:
    """The networks on one device, making chunks of images into `out_dir` (one per device)."""

    def __init__(self, weights: Weights, device: torch.device, out_dir: Path, label: str = ""):
        self.weights, self.out_dir = weights, out_dir
        self.label = label or str(device)
        self.networks = load_networks(weights.folder, use_ema=weights.use_ema, device=device)

    def run(self, chunk: Sequence[Item]) -> int:
        """Make the chunk's images that are not there yet; returns how many it made."""
        todo = [it for it in chunk if not (self.out_dir / it.file).exists()]
        if not todo:
            return 0
        start = time.perf_counter()
        first = todo[0]
        images = generate(
            self.networks,
            [it.prompt for it in todo],
            negative_prompt=first.negative_prompt,
            num_steps=first.num_steps,
            guidance_scale=first.guidance_scale,
            seed=[it.seed for it in todo],
        )
        for item, image in zip(todo, images, strict=True):
            info = PngImagePlugin.PngInfo()
            info.add_text("parameters", parameters_text(item, self.weights))
            with atomic_path(self.out_dir / item.file) as tmp:
                image.save(tmp, format="PNG", pnginfo=info)
        seconds = (time.perf_counter() - start) / len(todo)
        record = pa.table(
            {
                "file": [it.file for it in todo],
                "device": [self.label] * len(todo),
                "host": [socket.gethostname()] * len(todo),
                "seconds": pa.array([seconds] * len(todo), pa.float32()),
                "created": [time.time()] * len(todo),
            }
        )
        with atomic_path(self.out_dir / PARTS / f"{first.file[:-4]}.{os.getpid()}.parquet") as tmp:
            pq.write_table(record, tmp)
        return len(todo)


@contextlib.contextmanager
def batch_lock(out_dir: Path) -> Iterator[None]:
    """One batch at a time per output folder (two would remove each other's temporaries)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GenerateError(f"{out_dir}: another batch is writing to this folder") from None
        clean_temporaries(out_dir)  # images and records of a killed run, never renamed
        clean_temporaries(out_dir / PARTS)
        yield
    finally:
        os.close(fd)


class Progress:
    """Calls `on_progress(done, total)` once with the images already there, then per chunk."""

    def __init__(self, total: int, done: int, on_progress: Callable[[int, int], None] | None):
        self.total, self.done, self.on_progress = total, done, on_progress
        self.made = 0
        self.add(0)

    def add(self, n: int) -> None:
        self.done += n
        self.made += n
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)


def start(
    weights: str | Path,
    prompts: Sequence[str | Prompt],
    seeds: Sequence[int],
    out_dir: Path,
    *,
    settings: Settings,
    use_ema: bool,
) -> tuple[Weights, list[Item], list[Item]]:
    """(weights, every item of the batch, the items whose files are not there yet)."""
    w = open_weights(weights, use_ema=use_ema)
    items = plan(w, prompts, seeds, settings)
    there = {p.name for p in out_dir.iterdir()} if out_dir.is_dir() else set()
    return w, items, [it for it in items if it.file not in there]


def generate_images(
    weights: str | Path,
    prompts: Sequence[str | Prompt],
    seeds: Sequence[int],
    out_dir: str | Path,
    *,
    devices: Sequence[str | torch.device] | None = None,
    settings: Settings = DEFAULT_SETTINGS,
    use_ema: bool = True,
    batch_size: int = 8,
    on_progress: Callable[[int, int], None] | None = None,
) -> pa.Table:
    """Make every (prompt, seed) image of the batch that `out_dir` lacks; returns the index.

    `weights`: a run folder, its final/ or a checkpoint folder. `prompts`: strings (with
    `settings`) or `Prompt`s with their own. `devices`: one worker each (default: this
    process's best device); one device runs here, more run one process each, on their share.
    """
    out_dir = Path(out_dir)
    with batch_lock(out_dir):
        w, items, pending = start(
            weights, prompts, seeds, out_dir, settings=settings, use_ema=use_ema
        )
        progress = Progress(len(items), len(items) - len(pending), on_progress)
        chunks = make_chunks(pending, batch_size)
        devices = [torch.device(d) for d in devices] if devices else [pick_device()]
        if len(devices) == 1 or len(chunks) <= 1:
            if chunks:
                worker = DeviceWorker(w, devices[0], out_dir)
                for chunk in chunks:
                    progress.add(worker.run(chunk))
        else:
            _run_on_devices(w, devices, chunks, out_dir, progress)
        return finish(out_dir, w, items)


def _run_on_devices(
    weights: Weights,
    devices: Sequence[torch.device],
    chunks: Sequence[list[Item]],
    out_dir: Path,
    progress: Progress,
) -> None:
    """One process per device on its share of the chunks, reporting each chunk back."""
    shares = assign(chunks, len(devices))
    threads = max(1, len(os.sched_getaffinity(0)) // len(devices))
    ctx = multiprocessing.get_context("spawn")  # a process that holds CUDA cannot fork
    readers, procs = [], []
    for device, share in zip(devices, shares, strict=True):
        if not share:
            continue
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_device_process,
            args=(weights, str(device), share, out_dir, threads, writer, os.getpid()),
            name=f"generate-{device}",
        )
        proc.start()
        writer.close()  # the child's end: the reader sees EOF when the child is gone
        readers.append(reader)
        procs.append(proc)
    while readers:
        for reader in wait(readers):
            try:
                progress.add(reader.recv())
            except EOFError:
                readers.remove(reader)
    for proc in procs:
        proc.join()
    if failed := [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode != 0]:
        raise GenerateFailed(
            f"{', '.join(failed)} failed; {progress.made} images were made and kept, "
            "a rerun makes the rest"
        )


def _device_process(
    weights, device: str, chunks, out_dir: Path, threads: int, conn, parent: int
) -> None:
    _die_with(parent)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)  # the node's cores shared among its CPU workers
    worker = DeviceWorker(weights, device, out_dir)
    for chunk in chunks:
        conn.send(worker.run(chunk))
    conn.close()


def _die_with(parent: int) -> None:
    """End this worker when its coordinator dies, even by SIGKILL: an orphan would go on
    writing into a folder that a rerun is filling again."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def read_records(out_dir: Path) -> pa.Table | None:
    """Every chunk record of the folder, one row per file (the newest wins)."""
    parts = sorted((out_dir / PARTS).glob("*.parquet"))
    if not parts:
        return None
    table = pa.concat_tables([pq.read_table(p) for p in parts]).sort_by(
        [("file", "ascending"), ("created", "descending")]
    )
    files = table["file"].to_pylist()
    keep = [i for i, f in enumerate(files) if i == 0 or f != files[i - 1]]
    return table.take(keep)


def finish(out_dir: Path, weights: Weights, items: Sequence[Item]) -> pa.Table:
    """Check every image is there, write the index (plan + chunk records), compact records."""
    there = {p.name for p in out_dir.iterdir()}
    if missing := [it.file for it in items if it.file not in there]:
        raise GenerateFailed(f"{out_dir}: {len(missing)} of {len(items)} images missing")
    records = read_records(out_dir)
    by_file = {} if records is None else {r["file"]: r for r in records.to_pylist()}
    rows = []
    for it in items:
        record = by_file.get(it.file, {})  # none for images whose run was killed before it
        rows.append(
            {
                **asdict(it),
                "width": weights.resolution,
                "height": weights.resolution,
                "ema": weights.use_ema,
                "weights": str(weights.folder),
                "weights_sha256": weights.sha256,
                "device": record.get("device"),
                "host": record.get("host"),
                "seconds": record.get("seconds"),
            }
        )
    index = pa.Table.from_pylist(rows, schema=INDEX_SCHEMA)
    with atomic_path(out_dir / INDEX) as tmp:
        pq.write_table(index, tmp)
    if records is not None:
        _compact(out_dir / PARTS, records.filter(pc.is_in(records["file"], pa.array(list(there)))))
    return index


def _compact(parts: Path, records: pa.Table) -> None:
    """Replace the chunk records with one file of the same rows (a rerun reads one, not
    thousands); killed halfway, both are there and `read_records` keeps one row per file."""
    old = sorted(parts.glob("*.parquet"))
    with atomic_path(parts / "all.parquet") as tmp:
        pq.write_table(records, tmp)
    for p in old:
        if p.name != "all.parquet":
            p.unlink()


INDEX_SCHEMA = pa.schema(
    [
        ("prompt_index", pa.int32()),
        ("prompt", pa.string()),
        ("seed", pa.int64()),
        ("file", pa.string()),
        ("num_steps", pa.int32()),
        ("guidance_scale", pa.float64()),
        ("negative_prompt", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("ema", pa.bool_()),
        ("weights", pa.string()),
        ("weights_sha256", pa.string()),
        ("device", pa.string()),
        ("host", pa.string()),
        ("seconds", pa.float32()),
    ]
)
