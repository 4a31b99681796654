"""A data root an eval runs on, written directly: the demo source's fetched shard of procedural
scenes, scored by the real tiny scorer (so its stored embeddings are the score stage's), a phase
set of those rows (random latents, real tokens) and the phase's trained weights (`final/`).

One training image is planted: it is the image the eval will generate for its first prompt, so
memorisation must find that pair at cosine ~1.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from catalog import load_catalog
from sdtrain.checkpoint import write_checkpoint
from sdtrain.config import TrainConfig
from sdtrain.data import split_rows
from sdtrain.models import build_unet, tokenize
from tasks.curation import score
from tasks.evaluation.evaluate import prompts_of
from tasks.generation import generate as gen
from tests.tasks.conftest import scene_jpeg, write_fetched
from tests.tasks.tiny_weights import RUN_NEGATIVE, _perturbed

PHASE = "demo"
SOURCE = "demo"
NUM_ROWS = 20
NUM_VAL = 6
PLANTED = "demo-planted"


def write_weights(
    folder: Path, phase_dir: Path, seed_offset: int = 0, *, keep_every: int = 0
) -> Path:
    state = build_unet(load_catalog().model("tiny")).state_dict()
    config = TrainConfig(
        phase=PHASE, phase_dir=str(phase_dir), run_dir=str(folder.parent), model="tiny",
        lr=1e-4, warmup_steps=0, epochs=1, batch_size=1, cfg_dropout=0.1, min_snr_gamma=5.0,
        negative_prompt=RUN_NEGATIVE, num_val_samples=NUM_VAL, checkpoint_every=0,
        keep_every=keep_every,
    )  # fmt: skip
    return write_checkpoint(
        folder,
        unet=_perturbed(state, 1 + seed_offset),
        unet_ema=_perturbed(state, 2 + seed_offset),
        config=config,
    )


def first_eval_image(weights: Path, out: Path) -> bytes:
    """The PNG the eval generates for the demo eval set's first prompt and seed."""
    spec = load_catalog().eval_set("demo")
    prompts, _ = prompts_of(spec)
    index = gen.generate_images(weights, prompts[:1], [spec.seeds[0]], out, devices=["cpu"])
    return (out / index["file"][0].as_py()).read_bytes()


def write_eval_root(root: Path) -> Path:
    """The data root (see the module docstring); returns it."""
    phase_dir = root / "phases" / PHASE
    weights = write_weights(root / "runs" / PHASE / "final", phase_dir)
    planted = first_eval_image(weights, root / "tmp-first")
    train_rows, _ = split_rows(NUM_ROWS, NUM_VAL, seed=0)
    keys = [f"demo-{i:03d}" for i in range(NUM_ROWS)]
    keys[int(train_rows[0])] = PLANTED
    rows = []
    for i, key in enumerate(keys):
        image = planted if key == PLANTED else scene_jpeg(100 + i)
        rows.append({"key": key, "caption": f"a scene number {i}", "width": 256, "height": 256})
        rows[-1]["image"] = image
    write_fetched(root, SOURCE, rows)
    scorer = load_catalog().scorer("tiny-scoring")
    score.score_shard(root, SOURCE, "00000", scorer, device="cpu")

    (phase_dir / "latents").mkdir(parents=True)
    (phase_dir / "tokens").mkdir()
    latents = np.random.default_rng(0).standard_normal((NUM_ROWS, 4, 8, 8)).astype(np.float16)
    np.save(phase_dir / "latents" / f"{SOURCE}-00000.npy", latents)
    ids = tokenize([r["caption"] for r in rows]).to(torch.int32)
    tokens = pa.table({"key": keys, "input_ids": [i.tolist() for i in ids]})
    pq.write_table(tokens, phase_dir / "tokens" / f"{SOURCE}-00000.parquet")
    manifest = pa.table(
        {
            "source": [SOURCE] * NUM_ROWS,
            "shard": ["00000"] * NUM_ROWS,
            "latent_row": list(range(NUM_ROWS)),
            "token_row": list(range(NUM_ROWS)),
            "key": keys,
            "dataset": [SOURCE] * NUM_ROWS,
        }
    )
    pq.write_table(manifest, phase_dir / "manifest.parquet")
    return root


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")
