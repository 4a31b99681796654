"""Build the SD1.x networks and tokenizer named by a catalog model.

Design choices:
- A network is either loaded from `*_pretrained` (a local folder or a Hugging Face repo id
  already in the cache; `local_files_only` unless `SDPIPE_ALLOW_DOWNLOADS=1`) or built from
  `*_config` with seeded random weights: the tiny twins that tests and the demo use.
- A UNet built from config starts with its output projections zero-initialized (ResNet conv2,
  self- and cross-attention out, feed-forward out, transformer proj_out, conv_out), as the
  recipe did, so every block starts as the identity.
- The tokenizer is SD1's CLIP BPE, built offline from the vocabulary open_clip ships; ids are
  identical to `openai/clip-vit-large-patch14`'s tokenizer (pad with 49407, 77 ids). Captions
  are encoded by that tokenizer's own Rust pipeline, built once and trimmed for speed
  (`encode_captions`); `build_tokenizer()` is the transformers tokenizer it is tested against.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
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
    """SD1's CLIP tokenizer, built from the BPE vocabulary that open_clip ships.

    The transformers `CLIPTokenizer` (one per process): the reference that `encode_captions`
    is tested against, and what an exported pipeline saves.
    """
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


@functools.cache
def _fast_tokenizers():
    """(general, ascii): the reference's own `tokenizers` pipeline, trimmed for speed.

    Built once per process from `build_tokenizer()`'s backend, so vocabulary, merges, the
    added-token handling and the pre-tokenizer are the reference's. What is trimmed, and why
    the ids stay identical (tests/tasks/test_tokenize.py checks them against the reference):
    - both: no post-processor, padding or truncation: `encode_captions` lays out BOS, the
      first 75 ids, EOS and EOS padding in numpy, which is what the reference produces.
    - ascii, for ASCII captions without `<|`: no normalizer, and ByteLevel without its GPT-2
      regex. On ASCII text NFC is the identity and collapsing whitespace runs moves no split
      (no piece contains whitespace), so the normalizer reduces to lowercasing, done in
      Python; the normalizer keeps per-character alignments and costs about as much as the
      rest of the pipeline. The GPT-2 regex would re-split the pieces of CLIP's split regex,
      and each such piece (a letter run, one digit, a run of non-space non-letter
      non-digits, a contraction) is one GPT-2 match; only the `<|startoftext|>` and
      `<|endoftext|>` alternatives of CLIP's regex give pieces it splits, hence no `<|`.
      The `<|` rule is needed for the normalizer too: special tokens are matched before
      normalization (`normalized: false`), so `<|ENDOFTEXT|>` must not be lowercased first.
    """
    import json

    from tokenizers import Tokenizer

    spec = json.loads(build_tokenizer().backend_tokenizer.to_str())
    spec["post_processor"] = None
    spec["padding"] = None
    spec["truncation"] = None
    general = Tokenizer.from_str(json.dumps(spec))
    byte_level = spec["pre_tokenizer"]["pretokenizers"][-1]
    if byte_level["type"] != "ByteLevel":
        raise RuntimeError(f"unexpected CLIP pre-tokenizer: {spec['pre_tokenizer']}")
    byte_level["use_regex"] = False
    spec["normalizer"] = None
    ascii_only = Tokenizer.from_str(json.dumps(spec))
    return general, ascii_only


def encode_captions(captions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """SD1 CLIP ids [N, 77] int32, and each caption's token count [N] before truncation.

    Row layout: BOS 49406, the first 75 caption tokens, EOS 49407, padded with EOS; a caption
    whose count is over 75 was truncated. Ids equal `build_tokenizer()(captions,
    padding="max_length", truncation=True, max_length=77)`. A batch is encoded in Rust on the
    `tokenizers` thread pool (RAYON_NUM_THREADS; TOKENIZERS_PARALLELISM=false: one thread).
    """
    general, ascii_only = _fast_tokenizers()
    n = len(captions)
    ids = np.full((n, MAX_TOKENS), EOS_ID, np.int32)
    ids[:, 0] = BOS_ID
    counts = np.zeros(n, np.int64)
    ascii_rows, ascii_texts, other_rows, other_texts = [], [], [], []
    for i, text in enumerate(captions):
        if text.isascii() and "<|" not in text:
            ascii_rows.append(i)
            ascii_texts.append(text.lower())
        else:
            other_rows.append(i)
            other_texts.append(text)
    body = MAX_TOKENS - 2
    for tokenizer, rows, texts in (
        (ascii_only, ascii_rows, ascii_texts),
        (general, other_rows, other_texts),
    ):
        if not rows:
            continue
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        for i, encoding in zip(rows, encodings, strict=True):
            tokens = encoding.ids
            counts[i] = len(tokens)
            tokens = tokens[:body]
            ids[i, 1 : 1 + len(tokens)] = tokens
    return ids, counts


def tokenize(captions: list[str]) -> torch.Tensor:
    """Token ids [N, 77] int64: BOS, caption, EOS, padded with EOS, truncated at 77."""
    ids, _ = encode_captions(captions)
    return torch.from_numpy(ids.astype(np.int64))


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
