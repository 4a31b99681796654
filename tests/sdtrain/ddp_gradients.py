"""Under torchrun: the DDP-averaged UNet gradients of rows 0-7, each rank taking rows[rank::2].

Imported by test_train.py too, which computes the same loss on all 8 rows in one process.
Usage: torchrun --nproc_per_node 2 tests/sdtrain/ddp_gradients.py PHASE_DIR OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from catalog import load_catalog
from sdtrain.data import PhaseSet
from sdtrain.models import build_text_encoder, build_unet, tokenize
from sdtrain.objective import diffusion_loss, draw_noise
from sdtrain.sampling import encode_text

ROWS = list(range(8))


def unet_with_random_weights() -> torch.nn.Module:
    """The tiny UNet with every weight random: a zero-initialized one has mostly zero grads."""
    unet = build_unet(load_catalog().model("tiny"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in unet.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return unet


def loss_of(unet, phase_dir: str, rows: list[int]) -> torch.Tensor:
    """The trainer's loss on `rows`: their noise, timesteps and CFG drops, min-SNR weighted."""
    text_encoder = build_text_encoder(load_catalog().model("tiny"))
    items = [PhaseSet(phase_dir)[i] for i in rows]
    latents = torch.stack([latent for latent, _, _ in items])
    text_emb = encode_text(text_encoder, torch.stack([ids for _, ids, _ in items]))
    noise, timesteps, dropped = draw_noise(
        torch.tensor(rows), seed=0, epoch=0, latent_shape=(4, 8, 8), cfg_dropout=0.5
    )
    empty_emb = encode_text(text_encoder, tokenize([""]))
    text_emb = torch.where(dropped[:, None, None], empty_emb, text_emb)
    return diffusion_loss(
        unet, latents, text_emb, noise, timesteps, gamma=5.0, prediction_type="epsilon"
    )


if __name__ == "__main__":
    phase_dir, out = sys.argv[1:]
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(unet_with_random_weights())
    loss_of(ddp, phase_dir, ROWS[dist.get_rank() :: dist.get_world_size()]).backward()
    if dist.get_rank() == 0:
        torch.save({n: p.grad for n, p in ddp.module.named_parameters()}, out)
    dist.destroy_process_group()
    # torch's C++ teardown at interpreter exit races with a gloo thread under load ("terminate
    # called without an active exception", SIGABRT after the work is saved): skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
