"""The eval's results for people: each change judged against the right baseline and marked green
when better (lower FID, memorisation and loss; higher CLIP score and aesthetic), `sdpipe eval
--compare` printing two phases side by side, and the grid of the full eval set (9 categories x
20 prompts at SD1.5's 512 px) fitting the dashboard's artifact budget with nothing to fetch."""

from __future__ import annotations

import copy
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from catalog import load_catalog
from flows import cli
from tasks.evaluation import eval_report, evaluate
from tests.image_sources import markdown_sources, not_embedded


def summary_of(phase: str, previous: str | None, clip: float, fid: float, loss: float) -> dict:
    metrics = {
        "forest": {"clip_score": clip, "aesthetic": 5.0, "memorised": 0.10},
        "all": {"clip_score": clip, "aesthetic": 5.0, "memorised": 0.10, "fid": fid,
                "fid_reference": None, "val_loss_low": loss, "val_loss": loss},
    }  # fmt: skip
    return {
        "phase": phase,
        "eval_set": "default",
        "categories": ["forest"],
        "previous": previous,
        "num_images": 40,
        "metrics": metrics,
        "val_loss_start": {"val_loss_low": loss + 0.01, "val_loss": loss - 0.02},
        "fid": {"previous_on_this_validation": fid + 3.0},
    }


def test_changes_are_green_when_better_and_red_when_worse():
    before = summary_of("phase-6", "phase-5", clip=25.0, fid=40.0, loss=0.12)
    after = summary_of("phase-7", "phase-6", clip=26.5, fid=35.0, loss=0.11)
    after["metrics"]["forest"]["memorised"] = 0.25  # more memorised: worse
    after["metrics"]["forest"]["aesthetic"] = 4.5  # lower aesthetic: worse
    rows = {r["category"]: r for r in eval_report.table_rows(after, before)}
    assert rows["forest"]["clip_score"] == "26.50 +1.5 🟢"
    assert rows["forest"]["aesthetic"] == "4.500 -0.5 🔴"
    assert rows["forest"]["memorised"] == "25.0% +15pp 🔴"
    assert rows["forest"]["fid"] == ""  # FID is a number of the whole set
    # FID against the previous phase's generations on this phase's held-out images.
    assert rows["all"]["fid"] == "35 -3 🟢"
    # Validation losses against the starting weights on the same rows.
    assert rows["all"]["val_loss_low"] == "0.1100 -0.01 🟢"
    assert rows["all"]["val_loss"] == "0.1100 +0.02 🔴"
    assert rows["all"]["fid_reference"] == "n/a"
    first = {r["category"]: r for r in eval_report.table_rows(before, None)}
    assert first["forest"]["clip_score"] == "25.00"  # nothing to compare with


def test_compare_prints_two_phases_side_by_side(tmp_path, capsys):
    for phase, clip in (("phase-6", 25.0), ("phase-7", 24.0)):
        folder = tmp_path / "runs" / phase / "eval"
        folder.mkdir(parents=True)
        summary = summary_of(phase, None, clip=clip, fid=40.0, loss=0.12)
        (folder / evaluate.SUMMARY).write_text(json.dumps(summary, sort_keys=True))
    assert cli.main(["--data-root", str(tmp_path), "eval", "--compare", "6", "phase-7"]) == 0
    out = capsys.readouterr().out
    header, *lines = out.splitlines()
    assert header.split() == ["category", "metric", "phase-6", "phase-7", "change"]
    assert lines[0].split() == ["forest", "clip_score", "25.00", "24.00", "-1", "🔴"]
    assert ["all", "fid", "40", "40", "±0"] in [line.split() for line in lines]
    assert cli.main(["--data-root", str(tmp_path), "eval", "--compare", "6", "phase-3"]) == 2
    assert "no eval of phase-3" in capsys.readouterr().err


def test_the_full_eval_sets_grid_fits_the_artifact_budget_and_embeds_everything(tmp_path):
    spec = load_catalog().eval_set("default")
    prompts, categories = evaluate.prompts_of(spec)
    out = tmp_path / "runs" / "phase-7" / "eval"
    (out / evaluate.IMAGES).mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i, (prompt, category) in enumerate(zip(prompts, categories, strict=True)):
        name = f"{i:05d}-0-x.png"
        noise = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)  # incompressible, at 512 px
        Image.fromarray(noise).resize((512, 512)).save(
            out / evaluate.IMAGES / name, compress_level=0
        )
        rows.append({"category": category, "prompt": prompt.text, "seed": 0, "file": name,
                     "clip_score": 20.0 + i % 7, "aesthetic": 5.0})  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), out / evaluate.SCORES)
    summary = copy.deepcopy(summary_of("phase-7", None, clip=20.0, fid=1.0, loss=0.1))
    summary |= {"seeds": [0, 1], "num_steps": 100, "ema": True, "num_images": 360}
    summary["memorisation"] = {"threshold": 0.95, "num_training_rows": 1000, "worst": []}
    text = eval_report.grid_markdown(tmp_path, summary)
    sources = markdown_sources(text)
    assert len(sources) == len(spec.categories) == 9  # one grid per category
    assert not_embedded(sources) == []
    assert len(text.encode()) < 1_000_000
    for category in spec.categories:
        assert f"## {category.name}" in text
