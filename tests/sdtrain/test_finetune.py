"""The fine-tune modes' numbers on the tiny model, in this process: the prior-preservation loss
against a hand computation, the inpainting sampler's known region, the 9-channel expansion."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

from catalog import load_catalog
from sdtrain import inpaint
from sdtrain.config import FinetuneSettings, TrainConfig
from sdtrain.finetune import DreamBoothMode
from sdtrain.models import build_text_encoder, build_unet, tokenize
from sdtrain.objective import NOISE_SCHEDULE, draw_noise

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return load_catalog().model("tiny")


@pytest.fixture(scope="module")
def unet(model):
    """The tiny UNet with noise on every weight (a fresh one's zero output layers predict 0)."""
    unet = build_unet(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return unet


def write_data(folder, captions_by_kind: dict[str, list[str]]) -> None:
    """A data folder as tasks/finetune/data.py writes it, with random latents."""
    folder.mkdir(parents=True)
    kinds = [k for k, captions in captions_by_kind.items() for _ in captions]
    captions = [c for cs in captions_by_kind.values() for c in cs]
    ids = tokenize(captions).to(torch.int32).tolist()
    table = pa.table(
        {
            "key": [f"{i}.png" for i in range(len(kinds))],
            "kind": kinds,
            "caption": captions,
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
        }
    )
    pq.write_table(table, folder / "manifest.parquet")
    latents = np.random.default_rng(0).standard_normal((len(kinds), 4, 8, 8)).astype(np.float16)
    np.save(folder / "latents.npy", latents)


def test_prior_preservation_loss_is_the_hand_computation(model, unet, tmp_path):
    instance, cls = "a photo of sks dog", "a photo of dog"
    write_data(tmp_path / "data", {"instance": [instance] * 2, "class": [cls] * 3})
    weight = 0.5
    config = TrainConfig(
        phase="dog", phase_dir=str(tmp_path / "data"), run_dir=str(tmp_path / "run"),
        model="tiny", lr=1e-4, warmup_steps=0, epochs=1, batch_size=2, cfg_dropout=0.0,
        min_snr_gamma=0.0, channels_last=False,
        finetune=FinetuneSettings(mode="dreambooth", prior_loss_weight=weight),
    )  # fmt: skip
    mode = DreamBoothMode(config, model, CPU)
    data = mode.dataset()
    text_encoder = mode.prepare_text_encoder(build_text_encoder(model).eval(), None)
    # Pairs: instance i mod 2 with class i mod 3, over max(2, 3) items (diffusers' dataset).
    assert len(data) == 3
    latents_all = np.load(tmp_path / "data" / "latents.npy").astype(np.float32)
    assert torch.equal(data[2][0], torch.from_numpy(latents_all[[0, 4]]))
    batch = default_collate([data[0], data[1]])
    with torch.no_grad():
        loss = mode.loss(unet, batch, epoch=5)

    # By hand: samples [instance 0, class 0, instance 1, class 1], each its own noise and
    # timestep; diffusers' DDPM noising; the text encoder's embedding of each prompt.
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(**NOISE_SCHEDULE)
    samples = [(0, instance), (2, cls), (1, instance), (3, cls)]  # (latent row, prompt)
    noise, timesteps, _ = draw_noise(
        torch.arange(4), seed=config.seed, epoch=5, latent_shape=(4, 8, 8)
    )
    errors = []
    with torch.no_grad():
        for i, (row, prompt) in enumerate(samples):
            x0 = torch.from_numpy(latents_all[row : row + 1])
            noisy = scheduler.add_noise(x0, noise[i : i + 1], timesteps[i : i + 1])
            emb = text_encoder(tokenize([prompt])).last_hidden_state
            pred = unet(noisy, timesteps[i : i + 1], emb).sample
            errors.append(((pred - noise[i : i + 1]) ** 2).mean().item())
    instance_loss = (errors[0] + errors[2]) / 2
    class_loss = (errors[1] + errors[3]) / 2
    assert loss.item() == pytest.approx(instance_loss + weight * class_loss, rel=1e-5)
    assert class_loss > 0.01 and abs(instance_loss - class_loss) > 1e-4  # both halves count


def test_a_4_channel_fill_keeps_the_known_region_and_9_channels_start_as_the_base(model, unet):
    n = 2
    image_latents = torch.randn((n, 4, 8, 8), generator=torch.Generator().manual_seed(1))
    mask = inpaint.latent_mask(inpaint.demo_masks(n, size=64, seed=0), 8)
    assert 0 < mask.mean() < 1
    null = torch.zeros((n, 77, model.text_config["hidden_size"]))
    filled = inpaint.inpaint_latents(
        unet, image_latents, mask, None, null, None, num_steps=4, guidance_scale=1.0, seed=0
    )
    known = mask == 0
    known = known.expand_as(filled)
    assert torch.equal(filled[known], image_latents[known])  # re-imposed at the last step
    assert (filled[~known] - image_latents[~known]).abs().mean() > 0.1  # the hole is made

    wide = build_unet(model)
    wide.load_state_dict(unet.state_dict())
    inpaint.expand_conv_in(wide)
    assert wide.config.in_channels == 9 and wide.conv_in.weight.shape[1] == 9
    assert torch.count_nonzero(wide.conv_in.weight[:, 4:]) == 0
    x = torch.randn((n, 4, 8, 8))
    extra = torch.randn((n, 5, 8, 8))  # whatever mask and masked latents: zero weights
    emb = torch.randn((n, 77, model.text_config["hidden_size"]))
    with torch.no_grad():
        torch.testing.assert_close(
            wide(torch.cat([x, extra], 1), 500, emb).sample, unet(x, 500, emb).sample
        )


def test_training_masks_depend_on_seed_epoch_and_row_only():
    a = inpaint.training_masks(torch.tensor([3, 7]), seed=1, epoch=2, size=64)
    b = inpaint.training_masks(torch.tensor([7]), seed=1, epoch=2, size=64)
    assert torch.equal(a[1], b[0])
    assert not torch.equal(
        a[0], inpaint.training_masks(torch.tensor([3]), seed=1, epoch=3, size=64)[0]
    )
    many = inpaint.training_masks(torch.arange(200), seed=0, epoch=0, size=64)
    full = (many.flatten(1).mean(1) == 1).float().mean().item()
    assert 0.15 < full < 0.35  # about a quarter hide the whole image
    assert set(many.unique().tolist()) == {0.0, 1.0}


def test_a_dreambooth_lora_run_with_its_text_encoder_resumes_bitwise(
    model, unet, tmp_path, monkeypatch
):
    """A crash mid-run saves the last finished step; the rerun rebuilds the adapted UNet and
    text encoder, loads them, and ends where an uninterrupted run ends, bit for bit."""
    from safetensors.torch import load_file, save_file

    from sdtrain import finetune as finetune_module
    from sdtrain.monitor import read_log
    from sdtrain.train import train

    write_data(tmp_path / "data", {"instance": ["a photo of sks dog"] * 2, "class": ["dog"] * 3})
    save_file(unet.state_dict(), str(tmp_path / "base.safetensors"))

    def config(run: str) -> TrainConfig:
        return TrainConfig(
            phase="dog", phase_dir=str(tmp_path / "data"), run_dir=str(tmp_path / run),
            model="tiny", lr=1e-2, lr_schedule="constant", warmup_steps=0, epochs=100,
            max_steps=4, batch_size=2, cfg_dropout=0.0, min_snr_gamma=0.0, ema_decay=0.0,
            ema_carry=False, num_val_samples=0, checkpoint_every=1, keep_every=0,
            validate_every=0, log_every=1, sample_every=0, sample_steps=2, channels_last=False,
            gradient_checkpointing=False, deterministic=True,
            finetune=FinetuneSettings(
                mode="dreambooth", base_unet=str(tmp_path / "base.safetensors"),
                prior_loss_weight=1.0, train_text_encoder=True, lora_rank=4, lora_alpha=4.0,
            ),
        )  # fmt: skip

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = train(config("reference"))
        calls, draw_noise = [], finetune_module.draw_noise

        def failing_draw_noise(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # step 3
                raise RuntimeError("disk error")
            return draw_noise(*args, **kwargs)

        monkeypatch.setattr(finetune_module, "draw_noise", failing_draw_noise)
        with pytest.raises(RuntimeError, match="disk error"):
            train(config("run"))
        monkeypatch.setattr(finetune_module, "draw_noise", draw_noise)
        resumed = train(config("run"))
    finally:
        torch.set_num_threads(previous)
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == reference["steps"] == 4
    losses = [
        [(r["step"], r["loss"]) for r in read_log(tmp_path / run / "log.jsonl") if "loss" in r]
        for run in ("reference", "run")
    ]
    assert losses[0] == losses[1] and losses[0][0][1] != losses[0][-1][1]
    for name in ("unet", "unet_ema", "text_encoder"):
        a, b = (
            load_file(tmp_path / run / "final" / f"{name}.safetensors")
            for run in ("reference", "run")
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    trained = load_file(tmp_path / "run" / "final" / "unet.safetensors")
    assert any(".lora_B." in k and torch.count_nonzero(v) for k, v in trained.items())
