"""The eval stage on a small data root (tests/tasks/eval_data.py): the demo eval set's images
made by the batch generator, each image's scores and the per-category means, FID against the
held-out rows' images, the planted memorised image found, losses by band at the trainer's fixed
noise, the outputs on disk; a SIGKILLed eval's finished images are not made again."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from catalog import load_catalog
from sdtrain.config import TrainConfig
from sdtrain.data import PhaseSet, split_rows
from sdtrain.objective import VALIDATION_STREAM, diffusion_loss, draw_noise
from sdtrain.sampling import encode_text
from sdtrain.validation import BANDS, row_losses
from sdtrain.weights import load_networks
from tasks.curation import score
from tasks.curation.score import load_scorer
from tasks.evaluation import eval_metrics, eval_report, evaluate, fid
from tasks.runtime.shards import ShardStats, stats_path, write_record
from tests.tasks import eval_data
from tests.tasks.conftest import scene_jpeg, write_fetched

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = eval_data.write_eval_root(tmp_path_factory.mktemp("data"))
    summary = evaluate.evaluate(root, "demo", devices=["cpu"])
    return root, summary


def test_every_prompt_and_seed_is_made_scored_and_averaged_per_category(evaluated):
    root, summary = evaluated
    spec = load_catalog().eval_set("demo")
    out = root / "runs" / "demo" / "eval"
    table = pq.read_table(out / evaluate.SCORES).to_pylist()
    assert len(table) == sum(len(c.prompts) for c in spec.categories) * len(spec.seeds) == 9
    assert {r["category"] for r in table} == {c.name for c in spec.categories}
    assert all((out / evaluate.IMAGES / r["file"]).is_file() for r in table)
    assert {r["guidance_scale"] for r in table if r["category"] == "portrait"} == {8.5}
    assert {r["guidance_scale"] for r in table if r["category"] == "forest"} == {7.5}
    for category, values in summary["metrics"].items():
        rows = [r for r in table if category in ("all", r["category"])]
        assert values["clip_score"] == pytest.approx(np.mean([r["clip_score"] for r in rows]))
        assert values["aesthetic"] == pytest.approx(np.mean([r["aesthetic"] for r in rows]))
        assert values["memorised"] == pytest.approx(np.mean([r["memorised"] for r in rows]))
    for r in table:  # the per-image score is torchmetrics' definition of the stored cosine
        assert r["clip_score"] == pytest.approx(max(100 * r["clip_cosine"], 0))
    on_disk = json.loads((out / evaluate.SUMMARY).read_text())
    assert on_disk == summary
    # The text table (make demo, sdpipe eval) from the file: the eval set's order, `all` last,
    # then the whole set's numbers.
    lines = eval_report.format_table(on_disk, None).splitlines()
    assert [line.split()[0] for line in lines[2:12]] == [*on_disk["categories"], "all"]
    assert on_disk["categories"] == [c.name for c in spec.categories]
    (fid_line,) = [line for line in lines if line.startswith("fid ")]
    assert fid_line.split()[1] == eval_report.fmt("fid", summary["metrics"]["all"]["fid"])


def test_fid_is_against_the_held_out_rows_images(evaluated):
    root, summary = evaluated
    out = root / "runs" / "demo" / "eval"
    _, val_rows = split_rows(eval_data.NUM_ROWS, eval_data.NUM_VAL, seed=0)
    manifest = pq.read_table(root / "phases" / "demo" / "manifest.parquet").to_pydict()
    keys = {manifest["key"][i] for i in val_rows}
    images = eval_metrics.read_shard_images(root, "demo", "00000", keys)
    features = fid.FIDFeatures("", CPU, random_weights=True)
    generated, held_out = fid.Moments.empty(), fid.Moments.empty()
    generated.add(np.load(out / evaluate.FEATURES))
    held_out.add(features([fid.center_square(images[k]) for k in sorted(keys)]))
    assert summary["fid"]["num_validation"] == eval_data.NUM_VAL
    assert summary["metrics"]["all"]["fid"] == pytest.approx(fid.fid(generated, held_out))
    assert summary["metrics"]["all"]["fid"] > 0


def test_the_planted_training_copy_is_the_worst_pair(evaluated):
    _, summary = evaluated
    memo = summary["memorisation"]
    assert memo["num_training_rows"] == eval_data.NUM_ROWS - eval_data.NUM_VAL
    assert memo["embedded_here"] == []  # the demo source is scored with the eval's scorer
    worst = memo["worst"][0]
    assert (worst["key"], worst["category"]) == (eval_data.PLANTED, "forest")
    assert worst["similarity"] > 0.999
    assert [w["similarity"] for w in memo["worst"]] == sorted(
        [w["similarity"] for w in memo["worst"]], reverse=True
    )


def test_candidates_share_one_memorisation_scan_with_each_ones_own_results(
    evaluated, tmp_path, monkeypatch
):
    root, final = evaluated
    other = eval_data.write_weights(tmp_path / "other", root / "phases" / "demo", seed_offset=30)
    out = tmp_path / "other-eval"
    alone = evaluate.evaluate(root, "demo", weights=other, out_dir=out, devices=["cpu"])
    alone_table = pq.read_table(out / evaluate.SCORES)
    shutil.copytree(root / "runs" / "demo" / "eval" / evaluate.IMAGES, tmp_path / "f" / "images")
    scans = []
    real = eval_metrics.training_blocks
    monkeypatch.setattr(
        eval_metrics, "training_blocks", lambda *a, **k: scans.append(a) or real(*a, **k)
    )
    targets = [(None, tmp_path / "f"), (other, out)]  # images already there: none made again
    together = evaluate.evaluate_many(root, "demo", targets, devices=["cpu"])
    assert len(scans) == 1  # the training rows scanned once for both candidates
    final_table = pq.read_table(root / "runs" / "demo" / "eval" / evaluate.SCORES)
    for before, table, after, folder in (
        (final, final_table, together[0], tmp_path / "f"),
        (alone, alone_table, together[1], out),
    ):
        assert after["metrics"] == before["metrics"]  # memorised share included
        assert after["memorisation"] == before["memorisation"]
        assert after["weights"] == before["weights"]
        assert pq.read_table(folder / evaluate.SCORES).equals(table)
    assert together[0]["weights"] != together[1]["weights"]


def test_an_unscored_source_is_embedded_once_from_its_images(evaluated, tmp_path):
    root, _ = evaluated
    catalog = load_catalog()
    scorer = load_scorer(catalog.scorer("tiny-scoring"), CPU)
    keys = pq.read_table(root / "phases" / "demo" / "manifest.parquet")["key"].to_pylist()[:3]
    stored = list(
        eval_metrics.training_blocks(root, {("demo", "00000"): keys}, scorer, "tiny-scoring",
                                     {"demo": "tiny-scoring"})
    )  # fmt: skip
    computed = list(
        eval_metrics.training_blocks(root, {("demo", "00000"): keys}, scorer, "tiny-scoring",
                                     {"demo": ""})
    )  # fmt: skip
    cache = root / "demo" / eval_metrics.EMBEDDINGS / "tiny-scoring" / "00000.parquet"
    assert cache.is_file() and computed[0].computed and not stored[0].computed
    order = [stored[0].keys.index(k) for k in computed[0].keys]
    np.testing.assert_allclose(
        computed[0].embedding.astype(np.float32),
        stored[0].embedding[order].astype(np.float32),
        atol=2e-3,  # fp16 storage of the same embedding
    )
    mtime = cache.stat().st_mtime_ns
    list(eval_metrics.training_blocks(root, {("demo", "00000"): keys}, scorer, "tiny-scoring", {}))
    assert cache.stat().st_mtime_ns == mtime  # reused, not embedded again


def _weighted_scorer_spec(folder: Path):
    """The tiny scorer under its own name, with its twin's networks saved as weights files."""
    tiny = load_catalog().scorer("tiny-scoring")
    twin = load_scorer(tiny, CPU)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for role in ("embed", "similarity", "aesthetic", "nsfw", "watermark"):
        torch.save(getattr(twin, role).state_dict(), folder / f"{role}.bin")
        files[f"{role}_weights"] = str(folder / f"{role}.bin")
    return dataclasses.replace(tiny, random_weights=False, **files)


def _new_embed_weights(spec) -> None:
    """Other weights in the same file, under the same scorer name."""
    state = torch.load(spec.embed_weights)
    g = torch.Generator().manual_seed(1)
    torch.save({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()},
               spec.embed_weights)  # fmt: skip


def _fetch(root: Path, images: dict[str, bytes | None], *, refetched: int = 0) -> None:
    """The shard as fetch-images (or its refetch) leaves it: tar, sample table and record."""
    rows = [
        {"key": k, "caption": k, "width": 64, "height": 64, "image": image}
        | ({} if image else {"status": "http_503"})
        for k, image in images.items()
    ]
    write_fetched(root, "src", rows)
    num_out = sum(image is not None for image in images.values())
    stats = ShardStats(stage="shards", source="src", shard="00000", num_in=len(images),
                       num_out=num_out, dropped={"http_503": len(images) - num_out})  # fmt: skip
    stats.extra["refetched"] = refetched
    write_record(stats_path(root, "src", "shards", "00000"), stats)


def test_eval_embeddings_are_reused_by_the_same_scorer_and_made_again_by_other_weights(tmp_path):
    """Issue 33: the embeddings cache of a shard is keyed by the scorer's identity, not its
    name: the same scorer reuses it, new weights under the same name make it again."""
    spec = _weighted_scorer_spec(tmp_path / "weights")
    root = tmp_path / "root"
    _fetch(root, {"a": scene_jpeg(1, 64), "b": scene_jpeg(2, 64)})
    scorer = load_scorer(spec, CPU)
    out = eval_metrics.embedded_shard(root, "src", "00000", scorer, spec.name)
    made = (out.stat().st_ino, out.stat().st_mtime_ns)
    assert eval_metrics.embedded_shard(root, "src", "00000", scorer, spec.name) == out
    assert (out.stat().st_ino, out.stat().st_mtime_ns) == made  # reused

    _new_embed_weights(spec)
    other = load_scorer(spec, CPU)
    assert eval_metrics.embedded_shard(root, "src", "00000", other, spec.name) == out
    stored = pq.read_table(out)["embedding"].combine_chunks().flatten().to_numpy()
    images = [Image.open(io.BytesIO(scene_jpeg(i, 64))) for i in (1, 2)]
    expected = eval_metrics.embed_images(other, images).half().numpy().reshape(-1)
    np.testing.assert_array_equal(stored, expected)  # the new weights' embeddings


def test_eval_embeddings_are_made_again_after_a_refetch(tmp_path):
    """Issue 33: the embeddings cache of a shard is keyed by the shard's fetch record: a refetch
    (its record rewritten, a failed image fetched now) makes it again."""
    spec = _weighted_scorer_spec(tmp_path / "weights")
    root = tmp_path / "root"
    _fetch(root, {"a": scene_jpeg(1, 64), "b": scene_jpeg(2, 64), "c": None})
    scorer = load_scorer(spec, CPU)
    out = eval_metrics.embedded_shard(root, "src", "00000", scorer, spec.name)
    assert pq.read_table(out)["key"].to_pylist() == ["a", "b"]
    _fetch(root, {"a": scene_jpeg(1, 64), "b": scene_jpeg(2, 64), "c": scene_jpeg(3, 64)},
           refetched=1)  # fmt: skip
    eval_metrics.embedded_shard(root, "src", "00000", scorer, spec.name)
    assert pq.read_table(out)["key"].to_pylist() == ["a", "b", "c"]


def test_scores_of_other_weights_under_the_scorers_name_are_not_read(tmp_path):
    """Issue 33: the memorisation scan reads a shard's stored embeddings only where the shard is
    scored by the eval's very scorer (`score.shard_done`), not any scorer of its name."""
    spec = _weighted_scorer_spec(tmp_path / "weights")
    root = tmp_path / "root"
    _fetch(root, {"a": scene_jpeg(1, 64), "b": scene_jpeg(2, 64)})
    score.score_shard(root, "src", "00000", spec, device="cpu")
    rows, scored_with = {("src", "00000"): ["a", "b"]}, {"src": spec.name}
    scorer = load_scorer(spec, CPU)
    (block,) = eval_metrics.training_blocks(root, rows, scorer, spec.name, scored_with)
    assert not block.computed  # scored by this scorer: its scores' embeddings
    _new_embed_weights(spec)
    other = load_scorer(spec, CPU)
    (block,) = eval_metrics.training_blocks(root, rows, other, spec.name, scored_with)
    assert block.computed


def test_band_losses_are_the_trainers_validation_loss_split_by_timestep(evaluated):
    root, summary = evaluated
    weights = root / "runs" / "demo" / "final"
    networks = load_networks(weights, device=CPU)
    phase_set = PhaseSet(root / "phases" / "demo")
    _, val_rows = split_rows(eval_data.NUM_ROWS, eval_data.NUM_VAL, seed=0)
    losses = row_losses(
        networks.unet, networks.text_encoder, phase_set, val_rows,
        seed=0, gamma=5.0, prediction_type="epsilon", batch_size=4,
    )  # fmt: skip
    # The trainer's loss function on the same rows, noise and timesteps, as one batch.
    items = [phase_set[int(i)] for i in val_rows]
    latents = torch.stack([x for x, _, _ in items])
    noise, timesteps, _ = draw_noise(
        torch.tensor(val_rows), seed=0, epoch=0, latent_shape=(4, 8, 8), stream=VALIDATION_STREAM
    )
    with torch.no_grad():
        text = encode_text(networks.text_encoder, torch.stack([t for _, t, _ in items]))
        trainer = diffusion_loss(
            networks.unet, latents, text, noise, timesteps, gamma=5.0, prediction_type="epsilon"
        )
    assert losses.trainer_loss() == pytest.approx(float(trainer), rel=1e-5)
    assert summary["val_loss_trainer"] == pytest.approx(float(trainer), rel=1e-5)
    assert (losses.timesteps == timesteps.numpy()).all()
    by_band = losses.by_band()
    for band, (lo, hi) in BANDS.items():
        inside = (losses.timesteps >= lo) & (losses.timesteps < hi)
        expected = losses.mse[inside].mean() if inside.any() else None
        assert by_band[band] == pytest.approx(expected)
        assert summary["metrics"]["all"][f"val_loss_{band}"] == pytest.approx(expected)
    assert summary["metrics"]["all"]["val_loss"] == pytest.approx(losses.mse.mean())


KILLED_EVAL = """
import sys, torch
from pathlib import Path
torch.set_num_threads(1)
from tasks.evaluation.evaluate import evaluate
evaluate(Path(sys.argv[1]), "demo", devices=["cpu"])
"""


def test_a_killed_eval_does_not_make_its_finished_images_again(tmp_path, monkeypatch):
    root = eval_data.write_eval_root(tmp_path / "data")
    catalog = tmp_path / "catalog"
    from tests.conftest import write_small_catalog

    write_small_catalog(catalog)
    spec = (catalog / "eval.yaml").read_text().replace("batch_size: 9", "batch_size: 1")
    (catalog / "eval.yaml").write_text(spec)  # one image per chunk: a kill lands between them
    env = {**os.environ, "SDPIPE_CATALOG": str(catalog), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_EVAL, str(root)], env=env)
    images = root / "runs" / "demo" / "eval" / evaluate.IMAGES
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(list(images.glob("*.png"))) < 2:
        assert proc.poll() is None, "the eval ended before the kill"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {p.name: p.stat().st_ino for p in images.glob("*.png")}
    assert 2 <= len(before) < 9

    monkeypatch.setenv("SDPIPE_CATALOG", str(catalog))
    progress = []
    summary = evaluate.evaluate(
        root, "demo", devices=["cpu"], on_progress=lambda done, total: progress.append(done)
    )
    after = {p.name: p.stat().st_ino for p in images.glob("*.png")}
    assert {n: after[n] for n in before} == before  # the same files: not made again
    assert progress[0] == len(before) and progress[-1] == 9 == summary["num_images"]
    assert not (root / "runs" / "demo" / "eval" / evaluate.SUMMARY).is_symlink()
    assert not list((root / "runs" / "demo" / "eval").glob(".*tmp*"))


def test_checkpoint_choice_links_the_best_by_an_eval_metric(tmp_path):
    root = tmp_path
    phase_dir = root / "phases" / "demo"
    eval_data.write_weights(root / "runs" / "demo" / "final", phase_dir, keep_every=2)
    checkpoints = evaluate.run_checkpoints(root, "demo")  # the run's policy: keeps every 2nd
    for step, offset in ((2, 10), (4, 20), (6, 0)):  # step 6 holds final's weights
        folder = eval_data.write_weights(tmp_path / f"w{step}", phase_dir, seed_offset=offset)
        checkpoints.save(
            step,
            unet=load_file(str(folder / "unet.safetensors")),
            unet_ema=load_file(str(folder / "unet_ema.safetensors")),
            config=TrainConfig.from_json(folder / "config.json"),
        )
    found = evaluate.candidates(root, "demo")
    assert [(name, step) for name, _, step in found] == [
        ("final", 6),
        ("step-000002", 2),
        ("step-000004", 4),
    ]
    results = [
        {"name": "final", "step": 6, "value": 20.0},
        {"name": "step-000002", "step": 2, "value": 31.5},
        {"name": "step-000004", "step": 4, "value": 25.0},
    ]
    choice = evaluate.choose_checkpoint(root, "demo", "clip_score", results)
    assert choice["chosen"]["name"] == "step-000002" and choice["better"] == "higher"
    assert checkpoints.best("clip_score") == checkpoints.step_dir(2).resolve()
    by_fid = evaluate.choose_checkpoint(root, "demo", "fid", results)
    assert by_fid["chosen"]["name"] == "final" and by_fid["better"] == "lower"
    assert checkpoints.best("fid") == checkpoints.step_dir(6).resolve()
    assert json.loads((root / "runs" / "demo" / "eval" / evaluate.CHOICE).read_text()) == by_fid
