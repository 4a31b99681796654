"""eval: a phase's weights -> its eval set's images, scored per category: `runs/<phase>/eval/`.

Images come from the batch generator, whose file names say what each image depends on, so a
killed eval keeps what it made and a rerun makes only the rest. Everything else (CLIP score,
aesthetic, FID, memorisation, validation loss by band) is recomputed from the files on disk each
run: seconds next to generating, and the results are always those of the images there.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from catalog import Catalog, EvalSet, load_catalog
from sdtrain import layout
from sdtrain.atomic import atomic_path, write_json_atomic
from sdtrain.checkpoint import CheckpointDir, KeepPolicy
from sdtrain.config import TrainConfig
from sdtrain.data import PhaseSet, split_rows
from sdtrain.sampling import pick_device
from sdtrain.weights import WeightsNotFound, load_networks, resolve_weights
from tasks.curation.score import IMAGE_EXTENSIONS, load_scorer
from tasks.evaluation import eval_metrics, fid
from tasks.generation import generate as gen

IMAGES, SCORES, SUMMARY, FEATURES = "images", "images.parquet", "summary.json", "inception.npy"
CHOICE = "choice.json"
# Direction of each metric: +1 higher is better, -1 lower is better.
BETTER = {"clip_score": 1, "aesthetic": 1, "memorised": -1, "fid": -1, "fid_reference": -1}
BETTER |= {f"val_loss{b}": -1 for b in ("", "_low", "_mid", "_high")}


class EvalError(Exception):
    """An eval cannot run (no weights, no eval set); the message is one line naming what."""


def eval_dir(root: Path, phase: str) -> Path:
    return root / "runs" / phase / "eval"


def prompts_of(spec: EvalSet) -> tuple[list[gen.Prompt], list[str]]:
    """The eval set's prompts with their category's settings, and each prompt's category."""
    prompts, categories = [], []
    for cat in spec.categories:
        settings = gen.Settings(
            num_steps=spec.num_steps,
            guidance_scale=cat.guidance_scale,
            negative_prompt=spec.negative_prompt,
        )
        prompts += [gen.Prompt(text, settings) for text in cat.prompts]
        categories += [cat.name] * len(cat.prompts)
    return prompts, categories


def check_weights(catalog: Catalog, spec: EvalSet) -> None:
    """Fail naming every missing file of the eval's networks (the scorer's, the FID weights)
    before anything is generated, or anything trained by a curriculum that ends in an eval."""
    from tasks.curation.score import check_weights as check_scorer

    scorer = catalog.scorer(spec.scorer)
    if not scorer.random_weights:
        check_scorer(scorer)
    path = fid.weights_path(spec.fid_weights)
    if not spec.fid_random_weights and not path.is_file():
        raise fid.FIDWeightsError(
            f"eval set {spec.name!r}: FID weights not found: {path} (get {fid.WEIGHTS_URL}; "
            "relative paths are under SDPIPE_WEIGHTS, default ./weights)"
        )


def eval_set_of(catalog: Catalog, phase: str) -> EvalSet:
    spec = catalog.phase(phase)
    if not spec.eval_set:
        raise EvalError(f"{spec.name} names no eval set (eval_set in phases.yaml)")
    return catalog.eval_set(spec.eval_set)


def final_weights(root: Path, phase: str) -> Path:
    try:
        return resolve_weights(root / "runs" / phase / "final")
    except WeightsNotFound:
        raise EvalError(
            f"{phase} has no final weights ({root / 'runs' / phase / 'final'}): train it first"
        ) from None


@dataclass(frozen=True, slots=True)
class HeldOut:
    """A phase set's rows split as its trainer split them."""

    manifest: pa.Table
    train_rows: np.ndarray
    val_rows: np.ndarray

    @classmethod
    def of(cls, config: TrainConfig) -> HeldOut:
        manifest = pq.read_table(Path(config.phase_dir) / "manifest.parquet")
        train, val = split_rows(manifest.num_rows, config.num_val_samples, config.seed)
        return cls(manifest, train, val)

    def by_shard(self, rows: np.ndarray) -> dict[tuple[str, str], pa.Array]:
        """The keys of `rows` grouped by (source, shard), in row order within a shard: grouped
        in Arrow, one Python object per shard, none per row (100M training rows as Python
        strings would take ~44 GB)."""
        taken = self.manifest.select(["source", "shard", "key"]).take(pa.array(rows, pa.int64()))
        sources, source_code = layout.column_codes(taken["source"])
        shards, shard_code = layout.column_codes(taken["shard"])
        codes = source_code.astype(np.int64) * max(1, len(shards)) + shard_code
        order = np.argsort(codes, kind="stable")
        starts = np.flatnonzero(np.diff(codes[order], prepend=-1)) if len(codes) else order
        keys = (
            pa.concat_arrays(taken["key"].chunks) if taken.num_rows else pa.array([], pa.string())
        )
        out: dict[tuple[str, str], pa.Array] = {}
        for a, b in zip(starts.tolist(), [*starts[1:].tolist(), len(order)], strict=True):
            source, shard = divmod(int(codes[order[a]]), max(1, len(shards)))
            out[(sources[source], shards[shard])] = keys.take(pa.array(order[a:b]))
        return out


def evaluate(
    root: Path,
    phase: str,
    *,
    weights: str | Path | None = None,
    out_dir: Path | None = None,
    devices: list | None = None,
    reference_dir: str | Path | None = None,
    catalog: Catalog | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Evaluate a phase's weights (default: its final/, EMA unless the eval set says live) on
    its eval set; writes `images/`, `images.parquet`, `inception.npy`, `summary.json` into
    `out_dir` (default `runs/<phase>/eval/`) and returns the summary."""
    kwargs = dict(devices=devices, reference_dir=reference_dir, catalog=catalog, log=log)
    return evaluate_many(root, phase, [(weights, out_dir)], on_progress=on_progress, **kwargs)[0]


@dataclass(slots=True)
class _Candidate:
    """One weights folder's eval up to the memorisation scan, which all candidates share."""

    folder: Path
    out_dir: Path
    held_out: HeldOut
    index: pa.Table
    rows: list[dict]
    category: list[str]
    scores: eval_metrics.ImageScores
    generated: np.ndarray
    fid_report: dict
    losses: dict
    seconds: dict[str, float]
    scan_key: tuple  # candidates with the same one share the training rows
    prepared: float  # seconds up to the memorisation scan


def evaluate_many(
    root: Path,
    phase: str,
    targets: list[tuple[str | Path | None, Path | None]],
    *,
    devices: list | None = None,
    reference_dir: str | Path | None = None,
    catalog: Catalog | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """`evaluate` of several (weights, out_dir) of a phase (a run's final/ and checkpoints): each
    one's images and scores, then one memorisation scan over the training rows for all those
    that share them, then each one's files and summary, as `evaluate` of each alone would."""
    catalog = catalog or load_catalog()
    spec_phase, spec = catalog.phase(phase), eval_set_of(catalog, phase)
    check_weights(catalog, spec)
    devices = [torch.device(d) for d in devices] if devices else [pick_device()]
    device = devices[0]
    scorer = features = None
    candidates_: list[_Candidate] = []
    for k, (weights, out_dir) in enumerate(targets):
        started = time.monotonic()
        folder = resolve_weights(weights) if weights else final_weights(root, spec_phase.name)
        out_dir = Path(out_dir or eval_dir(root, spec_phase.name))
        config = TrainConfig.from_json(folder / "config.json")
        seconds: dict[str, float] = {}
        prompts, categories = prompts_of(spec)
        log(
            f"eval {spec_phase.name}: {len(prompts)} prompts x {len(spec.seeds)} seeds "
            f"({spec.name})"
        )
        mark = time.monotonic()
        index = gen.generate_images(
            folder,
            prompts,
            list(spec.seeds),
            out_dir / IMAGES,
            devices=devices,
            use_ema=spec.use_ema,
            batch_size=spec.batch_size,
            on_progress=on_progress and _progress_of(on_progress, k, len(targets)),
        )
        seconds["generate"] = time.monotonic() - mark
        rows = index.to_pylist()

        mark = time.monotonic()
        if scorer is None:
            scorer = load_scorer(catalog.scorer(spec.scorer), device)
            features = fid.FIDFeatures(
                spec.fid_weights, device, random_weights=spec.fid_random_weights
            )
        scores, generated = _per_image(out_dir / IMAGES, rows, scorer, features)
        seconds["clip_aesthetic_inception"] = time.monotonic() - mark

        held_out = HeldOut.of(config)
        mark = time.monotonic()
        previous = eval_dir(root, spec_phase.init_from) / FEATURES if spec_phase.init_from else None
        fid_report = _fid(root, held_out, features, generated, reference_dir, spec, previous, log)
        seconds["fid"] = time.monotonic() - mark

        mark = time.monotonic()
        losses = _val_losses(folder, config, held_out, spec, device)
        seconds["val_loss"] = time.monotonic() - mark
        category = [categories[r["prompt_index"]] for r in rows]
        scan_key = (str(Path(config.phase_dir).resolve()), config.num_val_samples, config.seed)
        candidates_.append(
            _Candidate(
                folder, out_dir, held_out, index, rows, category, scores, generated,
                fid_report, losses, seconds, scan_key,
                time.monotonic() - started,
            )
        )  # fmt: skip

    scanned = _memorisation(root, catalog, spec, candidates_, scorer, device)
    return [
        _finish(spec_phase, spec, c, blocks, nearest)
        for c, (blocks, nearest) in zip(candidates_, scanned, strict=True)
    ]


def _progress_of(on_progress: Callable[[int, int], None], k: int, n: int):
    """The k-th of n candidates' progress as a share of all candidates' images."""
    return lambda done, total: on_progress(k * total + done, n * total)


def _memorisation(root, catalog, spec, candidates_: list[_Candidate], scorer, device) -> list:
    """(counted blocks, nearest) of each candidate: one scan of the training rows for all
    candidates whose trainer held out the same rows of the same phase set (one block of training
    rows in memory at a time)."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(candidates_):
        groups.setdefault(c.scan_key, []).append(i)
    out: list = [None] * len(candidates_)
    for members in groups.values():
        mark = time.monotonic()
        held_out = candidates_[members[0]].held_out
        scored_with = {
            s: catalog.profile(catalog.source(s).profile).scorer
            for s in set(held_out.manifest["source"].to_pylist())
            if s in catalog.sources
        }
        blocks = eval_metrics.Counted(
            eval_metrics.training_blocks(
                root, held_out.by_shard(held_out.train_rows), scorer, spec.scorer, scored_with
            )
        )
        embeddings = [candidates_[i].scores.embedding for i in members]
        found = eval_metrics.nearest_training_many(embeddings, blocks, device)
        for i, nearest in zip(members, found, strict=True):
            out[i] = (blocks, nearest)
            candidates_[i].seconds["memorisation"] = time.monotonic() - mark  # shared
    return out


def _finish(spec_phase, spec: EvalSet, c: _Candidate, blocks, nearest) -> dict:
    """The candidate's table, summary and files, once its nearest training images are known."""
    rows, category, scores, index = c.rows, c.category, c.scores, c.index
    fid_report, losses, seconds, folder, out_dir = (
        c.fid_report, c.losses, c.seconds, c.folder, c.out_dir
    )  # fmt: skip
    generated, finishing = c.generated, time.monotonic()
    memorised = nearest.similarity >= spec.memorisation_threshold
    clip = eval_metrics.clip_score(scores.cosine)
    table = pa.table(
        {
            "category": pa.array(category, pa.string()),
            "prompt_index": index["prompt_index"],
            "prompt": index["prompt"],
            "seed": index["seed"],
            "file": index["file"],
            "guidance_scale": index["guidance_scale"],
            "clip_cosine": scores.cosine,
            "clip_score": clip,
            "aesthetic": scores.aesthetic,
            "nearest_source": pa.array(nearest.source, pa.string()),
            "nearest_shard": pa.array(nearest.shard, pa.string()),
            "nearest_key": pa.array(nearest.key, pa.string()),
            "nearest_similarity": nearest.similarity,
            "memorised": memorised,
        }
    )
    metrics: dict[str, dict[str, float | None]] = {}
    for name in [c.name for c in spec.categories] + ["all"]:
        mask = np.ones(len(rows), bool) if name == "all" else np.array(category) == name
        metrics[name] = {
            "clip_score": float(clip[mask].mean()),
            "aesthetic": float(scores.aesthetic[mask].mean()),
            "memorised": float(memorised[mask].mean()) if blocks.num_rows else None,
        }
    metrics["all"] |= {"fid": fid_report["fid"], "fid_reference": fid_report.get("fid_reference")}
    metrics["all"] |= losses["metrics"]
    worst = np.argsort(-nearest.similarity, kind="stable")[: spec.num_worst_pairs]
    summary = {
        "phase": spec_phase.name,
        "eval_set": spec.name,
        "previous": spec_phase.init_from,
        "weights": str(folder),
        "weights_sha256": rows[0]["weights_sha256"],
        "ema": spec.use_ema,
        "step": _step_of(folder),
        "num_images": len(rows),
        "categories": [c.name for c in spec.categories],  # in order (the JSON's keys are sorted)
        "seeds": list(spec.seeds),
        "num_steps": spec.num_steps,
        "metrics": metrics,
        "val_loss_start": losses["start"],
        "val_loss_trainer": losses["trainer"],
        "fid": {k: v for k, v in fid_report.items() if k not in ("fid", "fid_reference")},
        "memorisation": {
            "threshold": spec.memorisation_threshold,
            "num_training_rows": blocks.num_rows,
            "embedded_here": sorted(blocks.embedded_here),
            "worst": [
                {
                    "file": rows[i]["file"],
                    "category": category[i],
                    "prompt": rows[i]["prompt"],
                    "source": nearest.source[i],
                    "shard": nearest.shard[i],
                    "key": nearest.key[i],
                    "similarity": float(nearest.similarity[i]),
                }
                for i in worst
                if nearest.key[i] is not None
            ],
        },
        "seconds": {k: round(v, 2) for k, v in seconds.items()}
        | {"total": round(c.prepared + seconds["memorisation"] + time.monotonic() - finishing, 2)},
    }
    with atomic_path(out_dir / SCORES) as tmp:
        pq.write_table(table, tmp)
    with atomic_path(out_dir / FEATURES) as tmp, open(tmp, "wb") as f:
        np.save(f, generated)
    write_json_atomic(out_dir / SUMMARY, summary)
    return summary


def _per_image(images_dir: Path, rows: list[dict], scorer, features, batch_size: int = 32):
    """The scores and Inception features (float32 [N, 2048]) of the images, read a batch at a
    time: memory holds a batch of images, whatever the eval set's size."""
    parts, feats = [], []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        images = [Image.open(images_dir / r["file"]).convert("RGB") for r in batch]
        parts.append(eval_metrics.score_images(scorer, images, [r["prompt"] for r in batch]))
        feats.append(features(images).astype(np.float32))
    return eval_metrics.ImageScores.concat(parts), np.concatenate(feats)


def _step_of(folder: Path) -> int | None:
    """The optimizer step of a weights folder: a checkpoint's name, or the run's summary."""
    if folder.name.startswith("step-"):
        return int(folder.name[5:])
    run_summary = folder.parent / "summary.json"
    if folder.name == "final" and run_summary.is_file():
        import json

        return int(json.loads(run_summary.read_text())["steps"])
    return None


def _fid(root, held_out, features, generated, reference_dir, spec, previous, log) -> dict:
    """FID of the generations against the phase's held-out images (and a reference folder);
    with `previous` (the previous phase's eval features), that phase's FID against the same
    held-out images: the change on one footing."""
    mine = fid.Moments.empty(generated.shape[1])
    mine.add(generated)
    report: dict = {"num_generated": len(generated), "num_validation": len(held_out.val_rows)}
    report["fid"] = None
    if len(generated) < 2:  # a covariance needs two
        log("FID skipped: the eval set makes fewer than 2 images")
    elif len(held_out.val_rows) < 2:
        log("FID against held-out images skipped: the phase held out fewer than 2 rows")
    else:
        val = fid.Moments.empty(generated.shape[1])
        for (source, shard), column in sorted(held_out.by_shard(held_out.val_rows).items()):
            keys = column.to_pylist()  # the held-out rows: a few thousand
            images = eval_metrics.read_shard_images(root, source, shard, set(keys))
            # Shards keep each image's aspect; FID compares the squares the model makes.
            batch = [fid.center_square(images[k]) for k in keys if k in images]
            for i in range(0, len(batch), 32):
                val.add(features(batch[i : i + 32]))
        report["num_validation"] = val.count
        report["fid"] = fid.fid(mine, val) if val.count >= 2 else None
        if report["fid"] is not None and previous is not None and previous.is_file():
            before = fid.Moments.empty(generated.shape[1])
            before.add(np.load(previous))
            report["previous_on_this_validation"] = fid.fid(before, val)
    if reference_dir is not None and len(generated) >= 2:
        ref = reference_moments(root, Path(reference_dir), features, spec, log)
        report |= {"fid_reference": fid.fid(mine, ref), "reference_dir": str(reference_dir)}
        report["num_reference"] = ref.count
    return report


def reference_files(folder: Path) -> list[Path]:
    files = [p for p in folder.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS]
    if not files:
        raise EvalError(f"{folder}: no images (jpg, jpeg, png, webp) in the reference folder")
    return sorted(files)


def reference_moments(root: Path, folder: Path, features, spec: EvalSet, log) -> fid.Moments:
    """The Inception moments of a reference folder (each image's centered square), cached
    under `<root>/.cache/fid/` by the folder's listing (names, sizes, times) and FID weights."""
    files = reference_files(folder)
    listing = hashlib.sha256()
    for p in files:
        st = p.stat()
        listing.update(f"{p.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    listing.update(f"{spec.fid_weights}:{spec.fid_random_weights}".encode())
    cache = root / ".cache" / "fid" / f"{listing.hexdigest()[:20]}.npz"
    if cache.is_file():
        return fid.Moments.load(cache)
    log(f"FID reference: {len(files)} images of {folder} (cached in {cache} afterwards)")

    def images():
        for p in files:
            with Image.open(p) as im:
                yield fid.center_square(im.convert("RGB"))

    moments = fid.moments_of(features, images(), batch_size=32)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(cache) as tmp, open(tmp, "wb") as f:
        moments.save(f)
    return moments


def _val_losses(folder: Path, config: TrainConfig, held_out: HeldOut, spec, device) -> dict:
    """Unweighted MSE by timestep band on the held-out rows, of these weights and of the ones
    the phase started from (the same rows and noise: the phase's own change)."""
    from sdtrain.validation import row_losses

    out: dict = {"metrics": {}, "start": None, "trainer": None}
    if not len(held_out.val_rows):
        return out
    phase_set = PhaseSet(config.phase_dir)

    def bands(weights: Path) -> tuple[dict, float]:
        networks = load_networks(weights, use_ema=spec.use_ema, device=device)
        losses = row_losses(
            networks.unet,
            networks.text_encoder,
            phase_set,
            held_out.val_rows,
            seed=config.seed,
            gamma=config.min_snr_gamma,
            prediction_type=config.prediction_type,
        )
        by_band = losses.by_band()
        named = {("val_loss" if b == "all" else f"val_loss_{b}"): v for b, v in by_band.items()}
        return named, losses.trainer_loss()

    out["metrics"], out["trainer"] = bands(folder)
    if config.init_from and Path(config.init_from).is_dir():
        out["start"] = bands(Path(config.init_from))[0]
    return out


# ---- checkpoint choice --------------------------------------------------------------------------


def run_checkpoints(root: Path, phase: str) -> CheckpointDir:
    """The phase's checkpoint folder under its run's own keep policy (pruning follows it)."""
    config = TrainConfig.from_json(final_weights(root, phase) / "config.json")
    policy = KeepPolicy(checkpoint_every=config.checkpoint_every, keep_every=config.keep_every)
    return CheckpointDir(root / "runs" / phase / "checkpoints", policy)


def candidates(root: Path, phase: str) -> list[tuple[str, Path, int | None]]:
    """(name, folder, step) of the phase's final/ and every checkpoint whose EMA weights differ
    from final's (the last checkpoint holds the same weights as final/: it is final's step)."""
    final = final_weights(root, phase)
    final_sha = gen.open_weights(final).sha256
    found = [("final", final, None)]
    checkpoints = run_checkpoints(root, phase)
    for step in checkpoints.steps():
        folder = checkpoints.step_dir(step)
        if gen.open_weights(folder).sha256 == final_sha:
            found[0] = ("final", final, step)
        else:
            found.append((folder.name, folder, step))
    return found


def choose_checkpoint(root: Path, phase: str, metric: str, results: list[dict]) -> dict:
    """Point `checkpoints/best-by-<metric>` at the best result's step, so the keep policy keeps
    that checkpoint; write `eval/choice.json`. results: name, step, value per candidate."""
    direction = BETTER[metric]
    scored = [r for r in results if r["value"] is not None]
    if not scored:
        raise EvalError(f"no candidate of {phase} has a {metric} value")
    best = max(scored, key=lambda r: direction * r["value"])
    if best["step"] is not None:
        run_checkpoints(root, phase).point_best(best["step"], metric)
    choice = {"metric": metric, "better": "higher" if direction > 0 else "lower"}
    choice |= {"chosen": best, "candidates": results}
    write_json_atomic(eval_dir(root, phase) / CHOICE, choice)
    return choice
