"""What a run trains on and how it scores a batch: the hooks of the one training loop.

`train.py` owns the loop (DDP, accumulation, clipping, EMA, checkpoints, stops); a mode only
answers its questions: the dataset, the networks' structure, which parameters train, the loss
of a micro-batch, the picture of the run. A curriculum phase is `PhaseMode`; fine-tunes
(DreamBooth, inpainting, LoRA) are in sdtrain/finetune.py. No mode holds a loop of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from catalog import Model
from sdtrain import captions
from sdtrain.config import TrainConfig
from sdtrain.data import PhaseSet
from sdtrain.models import build_unet, tokenize
from sdtrain.objective import diffusion_loss, draw_noise
from sdtrain.sampling import decode_images, encode_text, image_grid, sample_latents


class PhaseMode:
    """A curriculum phase: captioned latents of a phase set, min-SNR loss, CFG dropout."""

    def __init__(self, config: TrainConfig, model: Model, device: torch.device):
        self.config, self.model, self.device = config, model, device
        self.text_encoder = self.empty_emb = None

    def dataset(self) -> PhaseSet:
        """Rows as (latent, input_ids, row); `latent_shape` (of the sample grids) is set from it:
        its latents' shape, or the model's square when the set holds several buckets."""
        config = self.config
        data = PhaseSet(
            config.phase_dir,
            in_ram=config.latents_in_ram,
            num_threads=config.load_threads,
            seed=config.seed,
            flip_p=config.flip_p,
            sample_latents=config.sample_latents,
            captions=captions.for_run(config),
            name=config.phase,
        )
        if len(data.bucket_names) == 1:
            self.latent_shape = tuple(data[0][0].shape)
        else:
            side = self.model.resolution // 8
            self.latent_shape = (4, side, side)
        return data

    def build_unet(self, *, resuming: bool) -> torch.nn.Module:
        """The UNet's structure and init; the loop loads the resumed or previous weights."""
        return build_unet(self.model, seed=self.config.seed)

    def prepare_text_encoder(self, text_encoder, resume_from: Path | None):
        """The frozen text encoder, and the CFG dropout's "no caption" embedding."""
        self.text_encoder = text_encoder
        self.empty_emb = encode_text(text_encoder, tokenize([""]))
        return text_encoder

    def ddp_module(self, unet, text_encoder) -> torch.nn.Module:
        return unet

    def trainable_parameters(self, unet, text_encoder) -> list[torch.nn.Parameter]:
        return list(unet.parameters())

    def extra_weights(self, text_encoder) -> dict[str, dict[str, torch.Tensor]]:
        """Weights files a checkpoint holds besides the UNet's (none: the rest is frozen)."""
        return {}

    def loss(self, ddp, batch, *, epoch: int) -> torch.Tensor:
        latents, input_ids, rows = batch
        config, device = self.config, self.device
        noise, timesteps, dropped = draw_noise(
            rows,
            seed=config.seed,
            epoch=epoch,
            latent_shape=tuple(latents.shape[1:]),  # a batch's bucket
            cfg_dropout=config.cfg_dropout,
            offset_noise=config.offset_noise,
        )
        latents, input_ids, noise, timesteps, dropped = (
            t.to(device, non_blocking=True) for t in (latents, input_ids, noise, timesteps, dropped)
        )
        text_emb = encode_text(self.text_encoder, input_ids)
        text_emb = torch.where(dropped[:, None, None], self.empty_emb, text_emb)
        return diffusion_loss(
            ddp,
            latents,
            text_emb,
            noise,
            timesteps,
            gamma=config.min_snr_gamma,
            prediction_type=config.prediction_type,
            channels_last=config.channels_last,
        )

    def sample_grid(self, unet, vae, autocast) -> Image.Image:
        """A grid of the sample prompts (DDIM, CFG against the negative prompt, no x0 clamp)."""
        config = self.config
        prompt_emb = encode_text(self.text_encoder, tokenize(list(config.sample_prompts)))
        negative_emb = encode_text(self.text_encoder, tokenize([config.negative_prompt]))
        with autocast():
            latents = sample_latents(
                unet,
                prompt_emb,
                negative_emb,
                latent_shape=(unet.config.in_channels, *self.latent_shape[1:]),
                num_steps=config.sample_steps,
                guidance_scale=config.guidance_scale,
                seed=config.seed,
                prediction_type=config.prediction_type,
            )
        return image_grid(decode_images(vae, latents.float(), self.model.scaling_factor))
