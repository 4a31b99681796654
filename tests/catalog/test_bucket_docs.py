"""Issue 26: what the docs say of bucket plans and latent files is what the code makes."""

from __future__ import annotations

import re
from pathlib import Path

from catalog import load_catalog
from catalog.buckets import BucketPlan
from catalog.loader import PACKAGED_DIR

REPO = Path(__file__).resolve().parents[2]


def widest(plan: BucketPlan) -> str:
    return f"{max(w / h for w, h in plan.sizes().tolist()):.2f}:1"


def test_the_docs_name_the_default_plans_buckets_and_its_widest():
    default = BucketPlan()  # kohya's / SimpleTuner's: 512^2 area, step 64, max_aspect 2
    tiny = BucketPlan.from_dict(load_catalog(PACKAGED_DIR).model("tiny").buckets, 64)
    assert widest(default) == widest(tiny) == "1.67:1"
    for path in (REPO / "docs" / "training-data.md", REPO / "catalog" / "models.yaml"):
        text = " ".join(path.read_text().split()).replace("# ", "")
        assert widest(default) in text, path
        assert ", ".join(default.names()[:-1]) + f" and {default.names()[-1]}" in text or (
            ", ".join(default.names()) in text
        ), path
        assert ", ".join(tiny.names()) in text, path


def test_the_readme_describes_the_bucketed_latent_files():
    text = " ".join((REPO / "README.md").read_text().split())
    assert "one `.npy` per shard" not in text
    assert re.search(r"latents/NNNNN\.WxH\.npy", text)
    assert "NNNNN.WxH.npy` per shard and aspect bucket" in text
