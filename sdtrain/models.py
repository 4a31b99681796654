"""Build the SD1.x networks and tokenizer named by a catalog model.

Design choices:
- A network is either loaded from `*_pretrained` (a local folder or a Hugging Face repo id
  already in the cache; `local_files_only` unless `SDPIPE_ALLOW_DOWNLOADS=1`) or built from
  `*_config` with seeded random weights: the tiny twins that tests and the demo use.
- A UNet built from config starts with its output projections zero-initialized (ResNet conv2,
  self- and cross-attention out, feed-forward out, transformer proj_out, conv_out), as the
  recipe did, so every block starts as the identity.
- The tokenizer is SD1's CLIP BPE, built offline from the vocabulary open_clip ships; ids are
  identical to `openai/clip-vit-large-patch14`'s tokenizer (pad with 49407, 77 ids).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
from pathlib import Path

import torch

from catalog import Model

MAX_TOKENS = 77
BOS_ID = 49406
EOS_ID = 49407


class ModelLoadError(Exception):
    """A pretrained model named in the catalog cannot be found locally."""


def _from_pretrained(cls, location: str, **kwargs):
    allow = os.environ.get("SDPIPE_ALLOW_DOWNLOADS") == "1"
    try:
        return cls.from_pretrained(location, local_files_only=not allow, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"cannot load {cls.__name__} from {location!r}: not a local folder and not in the "
            f"Hugging Face cache (set SDPIPE_ALLOW_DOWNLOADS=1 to download it): {e}"
        ) from None


def build_vae(model: Model, seed: int = 0):
    from diffusers import AutoencoderKL

    if model.vae_pretrained:
        return _from_pretrained(AutoencoderKL, model.vae_pretrained)
    torch.manual_seed(seed)
    return AutoencoderKL(**model.vae_config)


def build_text_encoder(model: Model, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel

    if model.text_pretrained:
        return _from_pretrained(CLIPTextModel, model.text_pretrained)
    torch.manual_seed(seed)
    return CLIPTextModel(CLIPTextConfig(**model.text_config))


def build_unet(model: Model, seed: int = 0):
    from diffusers import UNet2DConditionModel

    if model.unet_pretrained:
        return _from_pretrained(UNet2DConditionModel, model.unet_pretrained, subfolder="unet")
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**model.unet_config)
    zero_init_output_projections(unet)
    return unet


def zero_init_output_projections(unet) -> None:
    """Zero the last layer of every residual branch so each block starts as the identity."""
    from diffusers.models.attention import FeedForward
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    zeroed = []
    for module in unet.modules():
        if isinstance(module, ResnetBlock2D):
            zeroed.append(module.conv2)
        elif isinstance(module, Attention):
            zeroed.append(module.to_out[0])
        elif isinstance(module, FeedForward):
            zeroed.append([m for m in module.net if isinstance(m, torch.nn.Linear)][-1])
        elif isinstance(module, Transformer2DModel):
            zeroed.append(module.proj_out)
    zeroed.append(unet.conv_out)
    with torch.no_grad():
        for layer in zeroed:
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()


@functools.cache
def build_tokenizer():
    """SD1's CLIP tokenizer, built from the BPE vocabulary that open_clip ships."""
    from transformers import CLIPTokenizer

    # Located, not imported: importing open_clip (and timm with it) takes seconds.
    open_clip_dir = importlib.util.find_spec("open_clip").submodule_search_locations[0]
    bpe_path = Path(open_clip_dir) / "bpe_simple_vocab_16e6.txt.gz"
    with gzip.open(bpe_path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]
    byte_chars = list(_bytes_to_unicode().values())
    words = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges]
    words += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {w: i for i, w in enumerate(words)}
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        pad_token="<|endoftext|>",
        model_max_length=MAX_TOKENS,
    )


def tokenize(captions: list[str]) -> torch.Tensor:
    """Token ids [N, 77] int64: BOS, caption, EOS, padded with EOS, truncated at 77."""
    out = build_tokenizer()(
        captions,
        padding="max_length",
        truncation=True,
        max_length=MAX_TOKENS,
        return_tensors="pt",
    )
    return out.input_ids


def _bytes_to_unicode() -> dict[int, str]:
    # CLIP's reversible byte -> printable-unicode map (the order defines the first 256 ids).
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))
