"""The objective, schedules, EMA and run configs, one behaviour at a time (no training)."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from catalog import CatalogError, load_catalog
from catalog.loader import PACKAGED_DIR
from sdtrain.config import TrainConfig, run_config, run_config_for_phase
from sdtrain.data import EpochSampler, PhaseSet
from sdtrain.ema import EMA
from sdtrain.models import build_unet
from sdtrain.monitor import Monitor
from sdtrain.objective import (
    NOISE_SCHEDULE,
    add_noise,
    alphas_cumprod,
    diffusion_loss,
    draw_noise,
    min_snr_weights,
    velocity,
)
from sdtrain.runtime import Numerics, choose_numerics
from sdtrain.sampling import ddim_scheduler
from sdtrain.schedules import build_lr_schedule, ema_decay, total_optimizer_steps


def reference_alpha_bar() -> np.ndarray:
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    return np.cumprod(1 - betas)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_match_hand_computed_values(prediction_type):
    timesteps = [0, 100, 400, 999]
    gamma = 5.0
    weights = min_snr_weights(torch.tensor(timesteps), alphas_cumprod(), gamma, prediction_type)
    snr = reference_alpha_bar()[timesteps] / (1 - reference_alpha_bar()[timesteps])
    divisor = snr + 1 if prediction_type == "v_prediction" else snr
    np.testing.assert_allclose(weights.numpy(), np.minimum(snr, gamma) / divisor, rtol=1e-4)
    assert weights[0] < 0.01  # low noise is down-weighted; above gamma the weight is 1 for
    # epsilon, and SNR/(SNR+1) = alpha-bar for v (whose target already grows with the noise).
    high_noise = 1.0 if prediction_type == "epsilon" else reference_alpha_bar()[-1]
    assert weights[-1].item() == pytest.approx(high_noise, rel=1e-3)


def test_noising_and_v_target_are_the_schedulers():
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(**NOISE_SCHEDULE)
    latents, noise = torch.randn(6, 4, 8, 8), torch.randn(6, 4, 8, 8)
    timesteps = torch.tensor([0, 1, 250, 500, 998, 999])
    torch.testing.assert_close(
        add_noise(latents, noise, timesteps, alphas_cumprod()),
        scheduler.add_noise(latents, noise, timesteps),
    )
    torch.testing.assert_close(
        velocity(latents, noise, timesteps, alphas_cumprod()),
        scheduler.get_velocity(latents, noise, timesteps),
    )


def test_v_prediction_is_trained_and_sampled_with_the_same_alphas():
    """Seed bug: validating v-prediction with the other scheduler's alphas. A model that
    predicts v exactly has zero loss, and DDIM recovers x0 from that v exactly."""
    scheduler = ddim_scheduler("v_prediction")
    assert torch.equal(scheduler.alphas_cumprod, alphas_cumprod())
    assert scheduler.config.prediction_type == "v_prediction"
    latents, noise = torch.randn(4, 4, 8, 8), torch.randn(4, 4, 8, 8)
    timesteps = torch.tensor([10, 300, 700, 990])

    class Oracle(torch.nn.Module):  # knows x0: returns the true v for the x_t it is given
        def forward(self, noisy, t, text_emb):
            a = alphas_cumprod()[t].view(-1, 1, 1, 1)
            eps = (noisy - a.sqrt() * latents) / (1 - a).sqrt()
            return SimpleNamespace(sample=a.sqrt() * eps - (1 - a).sqrt() * latents)

    loss = diffusion_loss(
        Oracle(), latents, None, noise, timesteps, gamma=5.0, prediction_type="v_prediction"
    )
    assert loss.item() < 1e-9
    scheduler.set_timesteps(10)
    t = scheduler.timesteps[3]
    noisy = add_noise(latents, noise, t.repeat(4), alphas_cumprod())
    v = velocity(latents, noise, t.repeat(4), alphas_cumprod())
    x0 = scheduler.step(v, t, noisy).pred_original_sample
    torch.testing.assert_close(x0, latents, atol=1e-4, rtol=1e-4)


def test_cfg_dropout_rate_and_noise_are_per_sample_draws():
    rows = torch.arange(20_000)
    noise, timesteps, dropped = draw_noise(
        rows, seed=1, epoch=0, latent_shape=(4, 2, 2), cfg_dropout=0.15
    )
    assert dropped.float().mean().item() == pytest.approx(0.15, abs=0.01)
    assert timesteps.min() >= 0 and timesteps.max() <= 999
    assert noise.std().item() == pytest.approx(1.0, abs=0.01)
    # A row's draws depend on (seed, epoch, row) only: not on its batch, nor on its rank.
    again, t_again, d_again = draw_noise(
        torch.tensor([7, 3]), seed=1, epoch=0, latent_shape=(4, 2, 2), cfg_dropout=0.15
    )
    assert torch.equal(again, noise[[7, 3]]) and torch.equal(t_again, timesteps[[7, 3]])
    assert torch.equal(d_again, dropped[[7, 3]])
    next_epoch, _, _ = draw_noise(torch.tensor([7]), seed=1, epoch=1, latent_shape=(4, 2, 2))
    assert not torch.equal(next_epoch[0], noise[7])


def test_offset_noise_shifts_whole_channels():
    rows = torch.arange(4000)
    plain, _, _ = draw_noise(rows, seed=0, epoch=0, latent_shape=(4, 8, 8))
    offset, _, _ = draw_noise(rows, seed=0, epoch=0, latent_shape=(4, 8, 8), offset_noise=0.1)
    shift = offset - plain
    torch.testing.assert_close(shift, shift[:, :, :1, :1].expand_as(shift))  # one per channel
    assert shift[:, :, 0, 0].std().item() == pytest.approx(0.1, rel=0.05)


def test_total_steps_come_from_per_rank_loader_length(phase_dir):
    """Seed bug #1: total steps from the dataset length ended the cosine world_size x late."""
    sampler = EpochSampler(32, seed=0, rank=0, world_size=2)
    loader = DataLoader(PhaseSet(phase_dir), batch_size=4, sampler=sampler, drop_last=True)
    assert len(loader) == 4  # 32 rows / 2 ranks / batch 4, not 32 / 4
    assert total_optimizer_steps(len(loader), epochs=3, grad_accum=2, max_steps=None) == 6
    assert total_optimizer_steps(len(loader), epochs=3, grad_accum=2, max_steps=5) == 5


def test_lr_warms_up_from_one_percent_then_cosine_ends_at_one_percent():
    lr, warmup_steps, total_steps = 1e-3, 3, 10
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = build_lr_schedule(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)
    used = []
    for _ in range(total_steps):
        used.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert used[0] == pytest.approx(lr * 1e-2)
    assert used[: warmup_steps + 1] == sorted(used[: warmup_steps + 1])
    assert used[warmup_steps] == pytest.approx(lr)
    assert used[warmup_steps:] == sorted(used[warmup_steps:], reverse=True)
    assert schedule.get_last_lr()[0] == pytest.approx(lr * 1e-2)  # the floor, at total_steps


def test_ema_decay_warms_up_and_every_n_keeps_the_horizon():
    assert ema_decay(1) == pytest.approx(1 / 10)  # (1 + 0) / (10 + 0)
    assert ema_decay(11) == pytest.approx(11 / 20)
    assert ema_decay(10**6) == 0.9999  # capped at the decay
    assert ema_decay(10**6, every=10) == pytest.approx(0.9999**10)
    assert ema_decay(20, every=4) == pytest.approx(np.prod([ema_decay(s) for s in range(17, 21)]))

    # Against a fixed target, updating every 4 steps lands where updating every step does.
    source, target = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    every_step = EMA(source, decay=0.9999, every=1, device=torch.device("cpu"))
    every_4 = EMA(source, decay=0.9999, every=4, device=torch.device("cpu"))
    for step in range(1, 25):
        every_step.update(target, step)
        if every_4.due(step):
            every_4.update(target, step)
    for a, b in zip(every_step.shadow, every_4.shadow, strict=True):
        torch.testing.assert_close(a, b)


def test_ema_swaps_its_weights_in_and_out():
    module = torch.nn.Linear(2, 2)
    ema = EMA(module, decay=0.9999, every=1, device=torch.device("cpu"))
    live = [p.detach().clone() for p in module.parameters()]
    with torch.no_grad():
        for s in ema.shadow:
            s.fill_(7.0)
    with ema.swapped_into(module):
        assert all(torch.all(p == 7.0) for p in module.parameters())
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), live, strict=True))


def test_numerics_bf16_without_scaler_fp16_with_one_fp32_on_cpu(monkeypatch):
    assert choose_numerics(torch.device("cpu"), "auto") == Numerics(None, False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_numerics(cuda, "auto") == Numerics(torch.bfloat16, False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert choose_numerics(cuda, "auto") == Numerics(torch.float16, True)


def test_random_unet_starts_as_identity_blocks_with_zero_output():
    from diffusers.models.attention import FeedForward

    unet = build_unet(load_catalog(PACKAGED_DIR).model("tiny"))
    out = unet(torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 77, 32)).sample
    assert torch.count_nonzero(out) == 0
    ff_outs = [m.net[-1] for m in unet.modules() if isinstance(m, FeedForward)]
    assert ff_outs and all(torch.count_nonzero(layer.weight) == 0 for layer in ff_outs)


def test_a_phase_run_config_is_the_base_with_the_phases_settings(tmp_path):
    catalog = load_catalog(PACKAGED_DIR)
    base = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    phase_4 = run_config_for_phase(catalog.phase("phase-4"), phase_dir="p", run_dir="r")
    assert (phase_4.lr, phase_4.warmup_steps, phase_4.cfg_dropout) == (2e-6, 200, 0.15)
    assert (phase_4.batch_size, phase_4.grad_accum, phase_4.min_snr_gamma) == (24, 2, 5.0)
    for name in ("prediction_type", "ema_decay", "channels_last", "gradient_checkpointing"):
        assert getattr(phase_4, name) == base[name]  # the recipe's base settings
    demo = run_config_for_phase(catalog.phase("demo"), phase_dir="p", run_dir="r", init_from="f")
    assert (demo.num_val_samples, demo.gradient_checkpointing, demo.init_from) == (16, False, "f")
    assert demo.sample_prompts == catalog.phase("demo").sample_prompts

    shutil.copytree(PACKAGED_DIR, tmp_path / "c", ignore=shutil.ignore_patterns("*.py"))
    text = (tmp_path / "c" / "phases.yaml").read_text()
    (tmp_path / "c" / "phases.yaml").write_text(text.replace("log_every: 4", "log_every: 0"))
    with pytest.raises(CatalogError, match=r"demo\.log_every: must be >= 1, got 0"):
        load_catalog(tmp_path / "c")
    (tmp_path / "c" / "phases.yaml").write_text(
        text.replace("log_every: 4", "prediction_type: sample")
    )
    with pytest.raises(CatalogError, match="demo.prediction_type"):
        load_catalog(tmp_path / "c")


def test_a_finetune_run_config_comes_from_the_same_builder():
    # One builder for both (issue 34): the base run config, the entry's settings of the same
    # names, what every fine-tune run is, and what the caller derives; nothing given twice.
    spec = load_catalog(PACKAGED_DIR).finetunes["dog-lora"]
    base = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    config = run_config(spec, name="dog-lora/a", phase_dir="d", run_dir="r", model="sd15")
    assert (config.phase, config.model, config.lr, config.batch_size) == (
        "dog-lora/a",
        "sd15",
        1e-4,
        2,
    )
    assert (config.max_steps, config.lr_schedule, config.checkpoint_every) == (400, "constant", 100)
    assert (config.ema_decay, config.num_val_samples, config.min_snr_gamma) == (0.0, 0, 0.0)
    assert (config.adam_betas, config.sample_prompts) == (
        base["adam_betas"],
        base["sample_prompts"],
    )
    with pytest.raises(TypeError, match="multiple values for keyword argument 'lr'"):
        run_config(spec, name="dog-lora/a", phase_dir="d", run_dir="r", model="sd15", lr=1.0)


def test_wandb_is_imported_only_when_enabled(make_config, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    Monitor(make_config(tmp_path / "off"), start_step=0, enabled=True).close()
    with pytest.raises(RuntimeError, match="wandb_project='sd' is set but wandb is not installed"):
        Monitor(make_config(tmp_path / "on", wandb_project="sd"), start_step=0, enabled=True)
