"""Sampling and export: no x0 clamp, a real negative prompt, EMA weights, diffusers-loadable."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image
from safetensors.torch import load_file

from flows import cli
from sdtrain import sampling
from sdtrain.data import PhaseSet, split_rows
from sdtrain.models import tokenize
from sdtrain.monitor import read_log
from sdtrain.objective import alphas_cumprod
from sdtrain.sampling import (
    ddim_scheduler,
    decode_images,
    encode_text,
    generate,
    image_grid,
    initial_noise,
    sample_latents,
)
from sdtrain.train import validation_loss
from sdtrain.weights import load_networks

CPU = torch.device("cpu")


def test_ddim_never_clamps_x0_in_latent_space():
    """Seed bug: DDIM's pixel-space clamp of x0 to [-1, 1], applied to latents."""

    class ZeroNoise(torch.nn.Module):  # predicts no noise: x0 = x_t / sqrt(alpha-bar_t)
        def forward(self, x, t, text_emb):
            return SimpleNamespace(sample=torch.zeros_like(x))

    assert ddim_scheduler().config.clip_sample is False
    latents = sample_latents(
        ZeroNoise(),
        torch.zeros(2, 77, 8),
        torch.zeros(1, 77, 8),
        latent_shape=(4, 8, 8),
        num_steps=5,
        guidance_scale=7.5,
        seed=0,
    )
    scheduler = ddim_scheduler()
    scheduler.set_timesteps(5)
    initial = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    a_first, a_last = alphas_cumprod()[scheduler.timesteps[0]], alphas_cumprod()[0]
    torch.testing.assert_close(latents, initial * (a_last / a_first).sqrt())
    assert latents.abs().max() > 10  # a clamped x0 would keep every value within ~1


def test_one_seed_per_image_draws_each_images_own_noise():
    """Batch generation relies on it: an image's noise does not depend on its batch."""
    batch = initial_noise(3, (4, 8, 8), [7, 3, 7])
    for row, seed in zip(batch, [7, 3, 7], strict=True):
        torch.testing.assert_close(row[None], initial_noise(1, (4, 8, 8), seed), rtol=0, atol=0)
    one_seed = initial_noise(3, (4, 8, 8), 7)  # one seed: one draw for the batch, as before
    torch.testing.assert_close(one_seed[:1], batch[:1], rtol=0, atol=0)
    assert not torch.equal(one_seed[2], batch[2])
    with pytest.raises(ValueError, match="2 seeds for 3 images"):
        initial_noise(3, (4, 8, 8), [1, 2])


def test_negative_prompt_reaches_the_unet(one_rank_run, monkeypatch, tmp_path):
    """Seed bug: `--negative` parsed but never used (the negative half stayed the empty prompt)."""
    config, _ = one_rank_run
    networks = load_networks(config.run_dir, device=CPU)
    seen = []
    forward = networks.unet.forward

    def spy(sample, timestep, encoder_hidden_states, *args, **kwargs):
        seen.append(encoder_hidden_states)
        return forward(sample, timestep, encoder_hidden_states, *args, **kwargs)

    networks.unet.forward = spy
    prompts = ["a photo of object 1", "a photo of object 2"]
    with_negative = generate(networks, prompts, negative_prompt="blurry, ugly", num_steps=2)
    negative_emb = encode_text(networks.text_encoder, tokenize(["blurry, ugly"]))
    assert torch.equal(seen[0][:2], negative_emb.expand(2, -1, -1))
    assert torch.equal(seen[0][2:], encode_text(networks.text_encoder, tokenize(prompts)))
    without = generate(networks, prompts, negative_prompt="", num_steps=2)
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(with_negative, without, strict=True)
    )

    # The command line threads --negative through to generate().
    passed = {}

    def recording_generate(networks, prompts, **kwargs):
        passed.update(kwargs)
        return generate(networks, prompts, **kwargs)

    monkeypatch.setattr(sampling, "generate", recording_generate)
    out = tmp_path / "grid.png"
    argv = ["sample", *prompts, "--weights", config.run_dir, "--negative", "blurry, ugly"]
    assert cli.main([*argv, "--steps", "3", "--device", "cpu", "--out", str(out)]) == 0
    assert passed["negative_prompt"] == "blurry, ugly" and passed["num_steps"] == 3
    assert Image.open(out).size == (2 * 64, 64)


def test_validation_and_sample_grids_use_the_ema_weights(one_rank_run):
    """Seed bug: validation grids rendered from the live weights."""
    config, summary = one_rank_run
    run = Path(config.run_dir)
    logged = [r["val_loss"] for r in read_log(run / "log.jsonl") if "val_loss" in r][-1]
    ema, live = load_networks(run, device=CPU), load_networks(run, use_ema=False, device=CPU)
    phase_set = PhaseSet(config.phase_dir)
    _, val_rows = split_rows(len(phase_set), config.num_val_samples, config.seed)
    no_autocast = functools.partial(torch.autocast, "cpu", enabled=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        val_ema, val_live = (
            validation_loss(n.unet, phase_set, val_rows, n.text_encoder, config, no_autocast)
            for n in (ema, live)
        )
    finally:
        dist.destroy_process_group()
    assert val_ema == pytest.approx(logged, rel=1e-6)
    assert abs(val_live - logged) > 1e-4

    prompts = encode_text(ema.text_encoder, tokenize(list(config.sample_prompts)))
    negative = encode_text(ema.text_encoder, tokenize([config.negative_prompt]))
    latents = sample_latents(
        ema.unet,
        prompts,
        negative,
        latent_shape=(4, 8, 8),
        num_steps=config.sample_steps,
        guidance_scale=config.guidance_scale,
        seed=config.seed,
    )
    grid = image_grid(decode_images(ema.vae, latents, ema.model.scaling_factor))
    assert np.array_equal(np.asarray(Image.open(summary["sample_grid"])), np.asarray(grid))


def test_export_loads_in_diffusers_and_generates(one_rank_run, tmp_path):
    from diffusers import StableDiffusionPipeline

    config, summary = one_rank_run
    out = tmp_path / "tiny"
    assert cli.main(["export", str(out), "--weights", config.run_dir]) == 0
    pipeline = StableDiffusionPipeline.from_pretrained(out)
    assert pipeline.scheduler.config.clip_sample is False
    image = pipeline(
        "a photo of object 3",
        negative_prompt="blurry",
        num_inference_steps=2,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (64, 64)
    ema = load_file(Path(summary["checkpoint"]) / "unet_ema.safetensors")
    exported = pipeline.unet.state_dict()
    assert all(torch.equal(exported[k], ema[k]) for k in ema)  # EMA weights by default

    # The single file holds the same three networks under the original checkpoint's names.
    single = StableDiffusionPipeline.from_single_file(
        str(tmp_path / "tiny.safetensors"), config=str(out), local_files_only=True
    )
    for a, b in (
        (pipeline.unet, single.unet),
        (pipeline.vae, single.vae),
        (pipeline.text_encoder, single.text_encoder),
    ):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_missing_weights_are_one_line_errors(tmp_path, capsys):
    assert cli.main(["sample", "a cat", "--weights", str(tmp_path)]) == 2
    assert cli.main(["export", str(tmp_path / "out"), "--phase", "phase-12"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("sdpipe: error: ") for line in errors)
    assert "no trained weights" in errors[0] and "unknown phase" in errors[1]
