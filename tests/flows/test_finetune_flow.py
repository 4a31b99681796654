"""`sdpipe finetune` end to end on the tiny model, 2 gloo ranks, through the session's Prefect
server: DreamBooth (class images made by the base, trained, exported pipeline generates the
fine-tuned model's images), LoRA (adapters load with `load_lora_weights`, the base frozen), and
a sweep through the deployment and worker that trains seed 000's inpainting (demo grid) and a
9-channel inpainting model (loads in `StableDiffusionInpaintPipeline`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from flows import cli
from sdtrain import lora
from sdtrain.models import build_text_encoder
from sdtrain.monitor import read_log
from sdtrain.sampling import generate, initial_noise
from sdtrain.weights import load_networks
from tests.tasks import bad_images as bad
from tests.tasks.tiny_weights import RUN_NEGATIVE, write_tiny_weights

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
PROMPT = "a photo of sks dog on a beach"


@pytest.fixture(scope="module")
def root(prefect_stack, tmp_path_factory):
    """The session's data root with the demo fine-tunes' base (runs/demo/final) and images."""
    root, _ = prefect_stack
    write_tiny_weights(root / "runs" / "demo")
    colors = (bad.RED, bad.GREEN, bad.BLUE)
    for folder in ("demo-dreambooth/instance", "demo-lora/instance", "demo-inpaint/images"):
        path = root / "finetunes" / folder
        path.mkdir(parents=True)
        for i, color in enumerate(colors):
            rgb = bad.canvas(72, 64, color)
            rgb[8 + 8 * i : 40, 16:48] = bad.WHITE  # something to learn besides a color
            (path / f"{i}.jpg").write_bytes(bad.jpeg_of(rgb))
    return root


@pytest.fixture
def here(monkeypatch, tmp_path):
    """This process's GPU pool and device locks of its own; one torch thread (2 busy cores)."""
    monkeypatch.setenv("SDPIPE_DEVICE_LOCKS", str(tmp_path / "locks"))
    monkeypatch.setenv("SDPIPE_GPU_POOL", f"finetune-{os.getpid()}")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def finetune(root: Path, *args: str) -> int:
    from prefect.logging.handlers import APILogWorker

    try:
        return cli.main(["--data-root", str(root), "finetune", *args])
    finally:
        APILogWorker.drain_all()  # this process's run logs, sent while the server is up


def pipeline_image(pipe, prompt: str, *, seed: int, steps: int = 3, **kwargs) -> np.ndarray:
    """The pipeline's image from our sampler's initial noise, as uint8 (to compare with ours)."""
    side = pipe.unet.config.sample_size
    latents = initial_noise(1, (4, side, side), seed)
    out = pipe(
        prompt,
        negative_prompt=RUN_NEGATIVE,
        num_inference_steps=steps,
        latents=latents,
        output_type="np",
        **kwargs,
    ).images[0]
    return (out * 255).round().astype(np.int16)


def ours(run: Path, prompt: str, *, seed: int, steps: int = 3) -> np.ndarray:
    (image,) = generate(
        load_networks(run, device=CPU),
        [prompt],
        negative_prompt=RUN_NEGATIVE,
        num_steps=steps,
        seed=seed,
    )
    return np.asarray(image).astype(np.int16)


def test_dreambooth_makes_class_images_trains_and_exports_a_pipeline(root, here):
    from diffusers import StableDiffusionPipeline

    assert finetune(root, "demo-dreambooth") == 0
    folder = root / "finetunes" / "demo-dreambooth"
    index = pq.read_table(folder / "class-images" / "index.parquet").to_pylist()
    assert [(r["prompt"], r["seed"]) for r in index] == [("a photo of dog", s) for s in range(4)]
    assert {r["weights"] for r in index} == {str(root / "runs" / "demo" / "final")}
    run = folder / "runs" / "default"
    summary = (run / "summary.json").read_text()
    assert '"world_size": 2' in summary and '"steps": 4' in summary
    logged = [r for r in read_log(run / "log.jsonl") if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4] and {r["lr"] for r in logged} == {1e-3}
    assert (run / "samples" / "step-000002.png").is_file() and (
        run / "samples" / "final.png"
    ).is_file()
    # The text encoder trained too, and lives beside the UNet.
    trained = load_file(run / "final" / "text_encoder.safetensors")
    base_text = build_text_encoder(load_networks(run, device=CPU).model).state_dict()
    assert any(not torch.equal(trained[k], base_text[k]) for k in base_text)

    pipe = StableDiffusionPipeline.from_pretrained(run / "export")
    exported = pipeline_image(pipe, PROMPT, seed=7)
    assert np.abs(exported - ours(run, PROMPT, seed=7)).max() <= 2  # the fine-tuned model
    assert (
        np.abs(exported - ours(root / "runs" / "demo", PROMPT, seed=7)).max() > 10
    )  # not the base


def test_lora_adapters_load_with_load_lora_weights_and_the_base_stays_frozen(root, here):
    from diffusers import StableDiffusionPipeline

    assert finetune(root, "demo-lora") == 0
    run = root / "finetunes" / "demo-lora" / "runs" / "default"
    final = load_file(run / "final" / "unet.safetensors")
    base = load_file(root / "runs" / "demo" / "final" / "unet_ema.safetensors")
    assert any(lora.is_lora(k) for k in final)
    frozen = lora.base_state(final)
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)

    pipe = StableDiffusionPipeline.from_pretrained(run / "export")
    before = pipeline_image(pipe, PROMPT, seed=3)
    assert np.abs(before - ours(root / "runs" / "demo", PROMPT, seed=3)).max() <= 2  # the base
    pipe.load_lora_weights(run / "export")
    after = pipeline_image(pipe, PROMPT, seed=3)
    assert np.abs(after - before).max() > 10  # the adapters change the output ...
    assert np.abs(after - ours(run, PROMPT, seed=3)).max() <= 2  # ... into the fine-tuned model's


def test_a_sweep_runs_one_flow_run_per_value_through_the_deployment(root, capsys):
    """`--sweep inpaint_channels=4,9`: seed 000's mode and an inpainting model, as two flow runs
    of finetune/demo-inpaint on the worker (a learning-rate sweep is the same submission)."""
    from diffusers import StableDiffusionInpaintPipeline

    assert finetune(root, "demo-inpaint", "--sweep", "inpaint_channels=4,9", "--wait") == 0
    out = capsys.readouterr().out
    assert out.count("submitted ") == 2 and out.count(": Completed") == 2
    runs = root / "finetunes" / "demo-inpaint" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["inpaint_channels-4", "inpaint_channels-9"]

    # (a) seed 000: UNet only, unconditional; a checkpoint and a demo grid every 2 steps.
    seed000 = runs / "inpaint_channels-4"
    assert os.readlink(seed000 / "checkpoints" / "latest") == "step-000004"
    grid = Image.open(seed000 / "samples" / "step-000002.png")
    assert grid.size == (2 * 64, 3 * 64)  # 2 images: masked, filled, original
    masked = np.asarray(grid)[:64].astype(int)
    assert (np.abs(masked - 127).max(axis=2) == 0).mean() > 0.05  # the grayed-out rectangle
    assert list((seed000 / "tensorboard").glob("events.out.tfevents.*"))
    logged = [r for r in read_log(seed000 / "log.jsonl") if "loss" in r]
    assert len(logged) == 4 and all("lr" in r for r in logged)
    assert not (seed000 / "final" / "text_encoder.safetensors").exists()

    # (b) the 9-channel model loads in diffusers' inpainting pipeline and fills a hole.
    pipe = StableDiffusionInpaintPipeline.from_pretrained(runs / "inpaint_channels-9" / "export")
    assert pipe.unet.config.in_channels == 9
    image = Image.open(root / "finetunes" / "demo-inpaint" / "images" / "0.jpg").convert("RGB")
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    filled = pipe(
        "",
        image=image.resize((64, 64)),
        mask_image=Image.fromarray(mask),
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    assert filled.shape == (64, 64, 3) and np.isfinite(filled).all()
