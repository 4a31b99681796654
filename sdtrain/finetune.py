"""Fine-tune modes of the one training loop: DreamBooth with prior preservation, inpainting
(seed 000's unconditional UNet, or a 9-channel inpainting UNet), each with optional LoRA.

A fine-tune starts from its base's EMA weights (the ones that made its class images) and
keeps no average of its own: its EMA decay is 0, so the "EMA" that sampling, generation and
export read is the live weights. Its loss is the plain MSE of the DreamBooth paper and seeds
000/001 (no min-SNR weights, no caption dropout).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from torch.utils.data import Dataset

from catalog import Model
from sdtrain import inpaint, lora
from sdtrain.checkpoint import load_weights
from sdtrain.config import FinetuneSettings, TrainConfig
from sdtrain.models import build_unet, build_vae, tokenize
from sdtrain.modes import PhaseMode
from sdtrain.objective import add_noise, alphas_cumprod, draw_noise, velocity
from sdtrain.sampling import encode_text

TEXT_ENCODER_FILE = "text_encoder.safetensors"


class FinetuneSet(Dataset):
    """A fine-tune's data folder (tasks/finetune/data.py writes it): manifest.parquet (kind,
    caption, input_ids per row), latents.npy, and pixels.npy for inpainting.

    `pairs`: DreamBooth with prior preservation: item i is instance i mod n paired with class
    image i mod m, over max(n, m) items (diffusers' DreamBooth dataset). Otherwise the instance
    rows alone. At least `min_length` items (cycling), so a few images fill a global batch.
    Items: (latents [K,4,h,w], input_ids [K,77], row) for DreamBooth (K = 2 with
    pairs, else 1); (latent, input_ids, pixels, row) for inpainting.
    """

    def __init__(self, data_dir: str | Path, *, pairs: bool, inpainting: bool, min_length: int = 0):
        data_dir = Path(data_dir)
        manifest = pq.read_table(data_dir / "manifest.parquet")
        kinds = np.array(manifest["kind"].to_pylist())
        self.ids = np.array(manifest["input_ids"].to_pylist(), dtype=np.int64)
        self.latents = np.load(data_dir / "latents.npy", mmap_mode="r")
        self.pixels = np.load(data_dir / "pixels.npy", mmap_mode="r") if inpainting else None
        self.instance = np.flatnonzero(kinds == "instance")
        self.classes = np.flatnonzero(kinds == "class")
        self.pairs, self.inpainting, self.min_length = pairs, inpainting, min_length
        if pairs and not len(self.classes):
            raise ValueError(f"{data_dir}: prior preservation needs class images; there are none")

    def __len__(self) -> int:
        natural = max(len(self.instance), len(self.classes)) if self.pairs else len(self.instance)
        return max(natural, self.min_length)

    def _latents(self, rows: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.latents[rows].astype(np.float32))

    def __getitem__(self, i: int):
        if self.inpainting:
            r = int(self.instance[i % len(self.instance)])
            pixels = torch.from_numpy(np.array(self.pixels[r]))
            return self._latents([r])[0], torch.from_numpy(self.ids[r]), pixels, i
        rows = [int(self.instance[i % len(self.instance)])]
        if self.pairs:
            rows.append(int(self.classes[i % len(self.classes)]))
        return self._latents(rows), torch.from_numpy(self.ids[rows]), i


def unet_targets(settings: FinetuneSettings) -> tuple[str, ...]:
    """LoRA's targets: the attention projections; a 9-channel UNet's conv_in too, or its new
    mask channels (zero in the frozen base) could never learn."""
    nine = settings.mode == "inpaint" and settings.inpaint_channels == inpaint.INPAINT_CHANNELS
    return lora.UNET_TARGETS + (("conv_in",) if nine else ())


def finetune_unet(
    model: Model, settings: FinetuneSettings, *, seed: int = 0, load_base: bool = False
):
    """The fine-tune's UNet: the base (its weights when `load_base`), 9 input channels for an
    inpainting model, LoRA adapters when asked."""
    unet = build_unet(model, seed=seed)
    if load_base and settings.base_unet:
        unet.load_state_dict(load_weights(settings.base_unet))
    if settings.mode == "inpaint" and settings.inpaint_channels == inpaint.INPAINT_CHANNELS:
        inpaint.expand_conv_in(unet)
    if settings.lora_rank:
        lora.add_lora(
            unet,
            rank=settings.lora_rank,
            alpha=settings.lora_alpha,
            targets=unet_targets(settings),
            seed=seed,
        )
    return unet


def finetune_text_encoder(text_encoder, settings: FinetuneSettings, folder: Path | None):
    """A trained text encoder's structure (LoRA), with its weights from `folder` if given."""
    if not settings.train_text_encoder:
        return text_encoder
    if settings.lora_rank:
        lora.add_lora(
            text_encoder,
            rank=settings.lora_rank,
            alpha=settings.lora_alpha,
            targets=lora.TEXT_TARGETS,
            seed=0,
        )
    if folder is not None:
        text_encoder.load_state_dict(load_file(str(folder / TEXT_ENCODER_FILE)))
    return text_encoder


class _UNetWithText(torch.nn.Module):
    """UNet and trained text encoder as one module, so DDP averages the gradients of both."""

    def __init__(self, unet, text_encoder):
        super().__init__()
        self.unet, self.text_encoder = unet, text_encoder

    def forward(self, noisy, timesteps, input_ids):
        return self.unet(noisy, timesteps, self.text_encoder(input_ids).last_hidden_state)


def mse_per_sample(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))


def prior_preservation_loss(
    pred: torch.Tensor, target: torch.Tensor, *, num_kinds: int, weight: float
) -> torch.Tensor:
    """Instance loss + weight x class loss (each the batch's MSE) for samples laid out
    [instance 0, class 0, instance 1, class 1, ...] (`num_kinds` 2), or instances alone (1)."""
    per_kind = mse_per_sample(pred, target).view(-1, num_kinds).mean(dim=0)
    return per_kind[0] + weight * per_kind[1] if num_kinds == 2 else per_kind[0]


class FinetuneMode(PhaseMode):
    """What every fine-tune shares: its data folder, its UNet, a trained text encoder."""

    def __init__(self, config: TrainConfig, model: Model, device: torch.device):
        super().__init__(config, model, device)
        self.settings = config.finetune
        self.trains_text = self.settings.train_text_encoder

    def build_unet(self, *, resuming: bool):
        return finetune_unet(
            self.model, self.settings, seed=self.config.seed, load_base=not resuming
        )

    def prepare_text_encoder(self, text_encoder, resume_from: Path | None):
        text_encoder = finetune_text_encoder(text_encoder, self.settings, resume_from)
        if self.trains_text:
            text_encoder.train()
            if not self.settings.lora_rank:
                text_encoder.requires_grad_(True)
        return super().prepare_text_encoder(text_encoder, resume_from)

    def ddp_module(self, unet, text_encoder):
        return _UNetWithText(unet, text_encoder) if self.trains_text else unet

    def trainable_parameters(self, unet, text_encoder):
        modules = [unet, text_encoder] if self.trains_text else [unet]
        return [p for m in modules for p in m.parameters() if p.requires_grad]

    def extra_weights(self, text_encoder):
        return {TEXT_ENCODER_FILE: text_encoder.state_dict()} if self.trains_text else {}

    def global_batch(self) -> int:
        """Samples one optimizer step takes: a fine-tune's set is at least that long."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return self.config.batch_size * world_size * self.config.grad_accum

    def predict(self, ddp, latents, cond, noise, timesteps, extra_channels=None):
        """(prediction, target): `cond` is token ids when the text encoder trains (the DDP
        module encodes them), else embeddings."""
        alpha_bar = alphas_cumprod(latents.device)
        noisy = add_noise(latents, noise, timesteps, alpha_bar)
        if extra_channels is not None:
            noisy = torch.cat([noisy, extra_channels], dim=1)
        if self.config.channels_last:
            noisy = noisy.contiguous(memory_format=torch.channels_last)
        if self.config.prediction_type == "v_prediction":
            target = velocity(latents, noise, timesteps, alpha_bar)
        else:
            target = noise
        return ddp(noisy, timesteps, cond).sample, target


class DreamBoothMode(FinetuneMode):
    """Instance images with their prompt, paired with class images of the base model's."""

    def dataset(self) -> FinetuneSet:
        data = FinetuneSet(
            self.config.phase_dir,
            pairs=self.settings.prior_loss_weight > 0,
            inpainting=False,
            min_length=self.global_batch(),
        )
        self.latent_shape = tuple(data.latents.shape[1:])
        return data

    def loss(self, ddp, batch, *, epoch: int) -> torch.Tensor:
        latents, input_ids, rows = batch  # [B, K, 4, h, w], [B, K, 77], [B]
        num_kinds = latents.shape[1]
        # Each sample its own draws: instance 2r, class 2r + 1 of pair row r.
        samples = (rows[:, None] * num_kinds + torch.arange(num_kinds)).flatten()
        noise, timesteps, _ = draw_noise(
            samples, seed=self.config.seed, epoch=epoch, latent_shape=self.latent_shape
        )
        device = self.device
        latents, input_ids = latents.flatten(0, 1).to(device), input_ids.flatten(0, 1).to(device)
        noise, timesteps = noise.to(device), timesteps.to(device)
        cond = input_ids if self.trains_text else encode_text(self.text_encoder, input_ids)
        pred, target = self.predict(ddp, latents, cond, noise, timesteps)
        return prior_preservation_loss(
            pred, target, num_kinds=num_kinds, weight=self.settings.prior_loss_weight
        )


class InpaintMode(FinetuneMode):
    """Seed 000 (4 channels): unconditional, a zeros null embedding. 9 channels: the UNet also
    sees a random mask and the masked image's latents, and its images' captions."""

    def __init__(self, config: TrainConfig, model: Model, device: torch.device):
        super().__init__(config, model, device)
        self.nine = self.settings.inpaint_channels == inpaint.INPAINT_CHANNELS
        # Every rank encodes its masked images (the masks are random): a frozen VAE each.
        self.vae = build_vae(model).to(device).eval().requires_grad_(False) if self.nine else None

    def dataset(self) -> FinetuneSet:
        self.data = FinetuneSet(
            self.config.phase_dir, pairs=False, inpainting=True, min_length=self.global_batch()
        )
        self.latent_shape = tuple(self.data.latents.shape[1:])
        return self.data

    def prepare_text_encoder(self, text_encoder, resume_from: Path | None):
        text_encoder = super().prepare_text_encoder(text_encoder, resume_from)
        hidden = text_encoder.config.hidden_size
        self.null_emb = torch.zeros((1, self.empty_emb.shape[1], hidden), device=self.device)
        return text_encoder

    def conditioning(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.nine:
            return self.null_emb.expand(len(input_ids), -1, -1)
        return encode_text(self.text_encoder, input_ids)

    def loss(self, ddp, batch, *, epoch: int) -> torch.Tensor:
        latents, input_ids, pixels, rows = batch
        config, device = self.config, self.device
        noise, timesteps, _ = draw_noise(
            rows, seed=config.seed, epoch=epoch, latent_shape=self.latent_shape
        )
        latents, input_ids, pixels, noise, timesteps = (
            t.to(device) for t in (latents, input_ids, pixels, noise, timesteps)
        )
        extra = None
        if self.nine:
            masks = inpaint.training_masks(
                rows, seed=config.seed, epoch=epoch, size=pixels.shape[1]
            ).to(device)
            masked = inpaint.masked_image_latents(
                self.vae, pixels, masks, self.model.scaling_factor
            )
            extra = torch.cat([inpaint.latent_mask(masks, latents.shape[-1]), masked], dim=1)
        cond = self.conditioning(input_ids)
        pred, target = self.predict(ddp, latents, cond, noise, timesteps, extra)
        return mse_per_sample(pred, target).mean()

    def sample_grid(self, unet, vae, autocast) -> Image.Image:
        """The seed 000 demo: the first training images, a rectangle of each filled."""
        config = self.config
        rows = [int(r) for r in self.data.instance[: self.settings.num_demo_images]]
        latents = torch.from_numpy(self.data.latents[rows].astype(np.float32)).to(self.device)
        pixels = torch.from_numpy(np.array(self.data.pixels[rows])).to(self.device)
        input_ids = torch.from_numpy(self.data.ids[rows]).to(self.device)
        negative = None
        if self.nine:
            negative = encode_text(self.text_encoder, tokenize([config.negative_prompt]))
        with autocast():
            return inpaint.demo_grid(
                unet,
                vae,
                pixels,
                latents,
                self.conditioning(input_ids),
                negative,
                scaling_factor=self.model.scaling_factor,
                num_steps=config.sample_steps,
                guidance_scale=config.guidance_scale,
                seed=config.seed,
                prediction_type=config.prediction_type,
            )


def finetune_mode(config: TrainConfig, model: Model, device: torch.device) -> FinetuneMode:
    modes = {"dreambooth": DreamBoothMode, "inpaint": InpaintMode}
    return modes[config.finetune.mode](config, model, device)


def mode_for(config: TrainConfig, model: Model, device: torch.device):
    """The mode of a run: a fine-tune's (its `finetune` settings), else a phase's."""
    if config.finetune is None:
        return PhaseMode(config, model, device)
    return finetune_mode(config, model, device)
