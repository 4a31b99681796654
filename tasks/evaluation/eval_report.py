"""The eval for people: the category x metric table with changes, `--compare`, the image grid
and memorisation pairs as embedded pictures, TensorBoard scalars `eval/<metric>/<category>`.
A change is judged on one footing: generation metrics against the previous phase's eval (same
prompts and seeds), FID against the previous phase's generations on this phase's held-out
images, validation losses against the weights the phase started from, on the same rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from sdtrain.sampling import image_grid
from tasks.evaluation.eval_metrics import read_shard_images
from tasks.evaluation.evaluate import BETTER, IMAGES, SCORES, SUMMARY, eval_dir
from tasks.runtime import pictures

COLUMNS = (
    "clip_score",
    "aesthetic",
    "memorised",
    "fid",
    "fid_reference",
    "val_loss_low",
    "val_loss_mid",
    "val_loss_high",
    "val_loss",
)
UP, DOWN = "🟢", "🔴"  # better, worse (the table artifact has no colours of its own)
THUMB = 96  # px per image in the grid artifact
GRID_BUDGET = 900_000  # characters of all data URIs of the grid artifact (it stays under 1 MB)


def read_summary(root: Path, phase: str) -> dict | None:
    path = eval_dir(root, phase) / SUMMARY
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(metric: str, value: float | None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"  # a dash would render as a list bullet in the dashboard's table
    if metric == "memorised":
        return f"{100 * value:.1f}%"
    if metric.startswith("fid"):
        return f"{value:.4g}"
    if metric.startswith("val_loss"):
        return f"{value:.4f}"
    return f"{value:.3f}" if metric == "aesthetic" else f"{value:.2f}"


def baseline(summary: dict, previous: dict | None, category: str, metric: str) -> float | None:
    """What a value's change is measured against (see the module docstring)."""
    if metric.startswith("val_loss"):
        return (summary.get("val_loss_start") or {}).get(metric)
    if metric == "fid":
        return summary["fid"].get("previous_on_this_validation")
    if previous is None:
        return None
    return previous["metrics"].get(category, {}).get(metric)


def change(metric: str, value: float | None, before: float | None) -> str:
    """`+1.23 🟢` (better), `-0.40 🔴` (worse), `±0` or '' when there is nothing to compare."""
    if value is None or before is None:
        return ""
    delta = value - before
    scale = 100 if metric == "memorised" else 1
    text = f"{scale * delta:+.4g}{'pp' if metric == 'memorised' else ''}"
    if delta == 0:
        return "±0"
    return f"{text} {UP if delta * BETTER[metric] > 0 else DOWN}"


def categories(summary: dict) -> list[str]:
    """The eval set's categories in its order, then `all`."""
    return [*summary["categories"], "all"]


def table_rows(summary: dict, previous: dict | None) -> list[dict]:
    """Rows of the table artifact: a category each, then `all`, a column per metric holding
    the value and its change."""
    columns = [c for c in COLUMNS if any(c in m for m in summary["metrics"].values())]
    rows = []
    for category in categories(summary):
        values = summary["metrics"][category]
        row = {"category": category}
        for metric in columns:
            value = values.get(metric)
            moved = change(metric, value, baseline(summary, previous, category, metric))
            row[metric] = f"{fmt(metric, value)} {moved}".strip() if metric in values else ""
        rows.append(row)
    return rows


PER_CATEGORY = ("clip_score", "aesthetic", "memorised")


def format_table(summary: dict, previous: dict | None) -> str:
    """The table as text (make demo, sdpipe eval): the per-category metrics, then those of the
    whole set (FID, validation losses) one per line."""
    rows = table_rows(summary, previous)
    against = f" (changes against {previous['phase']})" if previous else ""
    head = f"eval {summary['phase']} on {summary['eval_set']}: {summary['num_images']} images"
    narrow = [{k: v for k, v in r.items() if k == "category" or k in PER_CATEGORY} for r in rows]
    (overall,) = [r for r in rows if r["category"] == "all"]
    whole = [(k, v) for k, v in overall.items() if k != "category" and k not in PER_CATEGORY]
    lines = [head + against, _text_table(narrow), ""]
    lines += [f"{k:<15}{v}" for k, v in whole]
    return "\n".join(lines)


def format_compare(a: dict, b: dict) -> str:
    """Two phases side by side, per category and metric: a, b and the change from a to b."""
    rows = []
    for category in dict.fromkeys([*categories(a), *categories(b)]):
        for metric in COLUMNS:
            va = a["metrics"].get(category, {}).get(metric)
            vb = b["metrics"].get(category, {}).get(metric)
            if va is None and vb is None:
                continue
            rows.append(
                {
                    "category": category,
                    "metric": metric,
                    a["phase"]: fmt(metric, va),
                    b["phase"]: fmt(metric, vb),
                    "change": change(metric, vb, va),
                }
            )
    notes = []
    if a["eval_set"] != b["eval_set"]:
        notes.append(f"note: other eval sets ({a['eval_set']} vs {b['eval_set']})")
    notes.append("FID and validation losses are each against its own phase's held-out rows")
    return _text_table(rows) + "\n" + "\n".join(notes)


def _text_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    width = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(width[k]) for k in keys)]
    lines += ["  ".join(str(r.get(k, "")).ljust(width[k]) for k in keys) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


# ---- pictures ------------------------------------------------------------------------------


def _labelled(image: Image.Image, text: str, side: int) -> Image.Image:
    """`image` shrunk to `side`, with a line of text under it."""
    font = ImageFont.load_default(size=11)
    out = Image.new("RGB", (side, side + 16), "white")
    out.paste(image.convert("RGB").resize((side, side), Image.Resampling.LANCZOS), (0, 0))
    ImageDraw.Draw(out).text((2, side + 2), text[:24], fill="black", font=font)
    return out


def grid_markdown(root: Path, summary: dict, out_dir: Path | None = None) -> str:
    """One image per prompt (the first seed) per category, and the generations nearest to a
    training image beside it: JPEG data URIs, under the artifact budget."""
    import pyarrow.parquet as pq

    out_dir = out_dir or eval_dir(root, summary["phase"])
    table = pq.read_table(out_dir / SCORES).to_pylist()
    first_seed = summary["seeds"][0]
    by_category: dict[str, list[dict]] = {}
    for r in table:
        if r["seed"] == first_seed:
            by_category.setdefault(r["category"], []).append(r)
    worst = summary["memorisation"]["worst"]
    budget = GRID_BUDGET // (len(by_category) + (1 if worst else 0))
    lines = [
        f"# eval {pictures.md_text(summary['phase'])}: one image per prompt (seed {first_seed})",
        f"{summary['num_images']} images, {summary['num_steps']} DDIM steps, "
        f"{'EMA' if summary['ema'] else 'live'} weights; scores per image in "
        f"{pictures.md_code(out_dir / SCORES, limit=300)}",
    ]
    for category, rows in by_category.items():
        tiles = []
        for r in rows:
            with Image.open(out_dir / IMAGES / r["file"]) as im:
                tiles.append(_labelled(im, f"{r['clip_score']:.1f} / {r['aesthetic']:.2f}", THUMB))
        grid = image_grid(tiles, num_cols=min(10, len(tiles)))
        uri = pictures.fitted_jpeg_uri(grid, max_width=10 * THUMB, max_chars=budget)
        lines += ["", f"## {pictures.md_text(category)}", "CLIP score / aesthetic under each", ""]
        lines += [f"![{pictures.md_text(category)}]({uri})"]
    if worst:
        lines += ["", _memorisation_markdown(root, summary, out_dir, budget)]
    return "\n".join(lines) + "\n"


def _memorisation_markdown(root: Path, summary: dict, out_dir: Path, budget: int) -> str:
    memo = summary["memorisation"]
    pairs = []
    for w in memo["worst"]:
        train = read_shard_images(root, w["source"], w["shard"], {w["key"]}).get(w["key"])
        with Image.open(out_dir / IMAGES / w["file"]) as generated:
            left = _labelled(generated, f"{w['category']}", 2 * THUMB)
        right = _labelled(
            train if train is not None else Image.new("RGB", (8, 8), "grey"),
            f"cos {w['similarity']:.3f}",
            2 * THUMB,
        )
        pair = Image.new("RGB", (4 * THUMB + 8, left.height), "white")
        pair.paste(left, (0, 0))
        pair.paste(right, (2 * THUMB + 8, 0))
        pairs.append(pair)
    sheet = image_grid(pairs, num_cols=2)
    uri = pictures.fitted_jpeg_uri(sheet, max_width=8 * THUMB + 16, max_chars=budget)
    share = summary["metrics"]["all"].get("memorised")
    lines = [
        "## Nearest training images",
        f"generation (left) and its nearest training image (right) by ViT-L/14 embedding "
        f"cosine; {fmt('memorised', share)} of generations at or above "
        f"{memo['threshold']} over {memo['num_training_rows']} training images",
        "",
        f"![generation / nearest training image]({uri})",
        "",
    ]
    lines += [
        f"- {pictures.md_code(w['file'])} ~ {pictures.md_code(w['source'] + '/' + w['key'])}: "
        f"{w['similarity']:.4f}"
        for w in memo["worst"]
    ]
    return "\n".join(lines)


def choice_markdown(choice: dict) -> str:
    """The checkpoints compared by the eval set's metric and the one it chose."""
    metric = choice["metric"]
    lines = [
        "",
        f"## Checkpoint choice by {metric} ({choice['better']} is better)",
        "",
        f"| weights | step | {metric} |",
        "|---|---|---|",
    ]
    for c in choice["candidates"]:
        mark = " (chosen)" if c["name"] == choice["chosen"]["name"] else ""
        lines.append(f"| {c['name']}{mark} | {c['step']} | {fmt(metric, c['value'])} |")
    return "\n".join(lines) + "\n"


def write_tensorboard(root: Path, summary: dict) -> Path:
    """Scalars `eval/<metric>/<category>` in `runs/<phase>/tensorboard/eval/`, at the
    weights' step (beside the phase's training curves in the same TensorBoard)."""
    from torch.utils.tensorboard import SummaryWriter

    folder = root / "runs" / summary["phase"] / "tensorboard" / "eval"
    writer = SummaryWriter(str(folder))
    step = summary["step"] or 0
    for category, values in summary["metrics"].items():
        for metric, value in values.items():
            if value is not None:
                writer.add_scalar(f"eval/{metric}/{category}", value, step)
    writer.close()
    return folder
