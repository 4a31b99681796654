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
  `encode_captions` is the fast path (a piece cache for ASCII captions, the tokenizer's own
  Rust pipeline for the rest); `build_tokenizer()` is the transformers tokenizer it is
  tested against.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from catalog import Model
from sdtrain.lazy import BUILD_LOCK, once

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


# Builders run under BUILD_LOCK: the libraries' lazy imports are not thread-safe, and a
# random-weight twin seeds the global RNG, so two builds at once would interleave their draws.


def build_vae(model: Model, seed: int = 0):
    with BUILD_LOCK:
        from diffusers import AutoencoderKL

        if model.vae_pretrained:
            return _from_pretrained(AutoencoderKL, model.vae_pretrained)
        torch.manual_seed(seed)
        return AutoencoderKL(**model.vae_config)


def build_text_encoder(model: Model, seed: int = 0):
    with BUILD_LOCK:
        from transformers import CLIPTextConfig, CLIPTextModel

        if model.text_pretrained:
            return _from_pretrained(CLIPTextModel, model.text_pretrained)
        torch.manual_seed(seed)
        return CLIPTextModel(CLIPTextConfig(**model.text_config))


def build_unet(model: Model, seed: int = 0):
    with BUILD_LOCK:
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


@once
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


@once
def _fast_tokenizers():
    """(general, pieces): the reference's own `tokenizers` pipeline, trimmed for speed.

    Built once per process from `build_tokenizer()`'s backend, so vocabulary, merges, the
    added-token handling and the pre-tokenizer are the reference's. Both lose the
    post-processor, padding and truncation: `encode_captions` lays out BOS, the first 75 ids,
    EOS and EOS padding in numpy, which is what the reference produces. `pieces` encodes
    single pre-tokenized pieces of lowercased ASCII text (see `_ASCII_PIECES`): it has no
    normalizer (a piece is already lowercase ASCII: NFC and whitespace folding leave it as it
    is) and ByteLevel runs without its GPT-2 regex, which would re-split a piece only if it
    were `<|startoftext|>` or `<|endoftext|>` (every other CLIP piece, a letter run, one
    digit, a contraction or a run of other non-space characters, is one GPT-2 match).
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
    pieces = Tokenizer.from_str(json.dumps(spec))
    return general, pieces


# CLIP's split regex (`'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+`, kept
# matches, the rest dropped) for lowercased ASCII text without `<|` (so its `<|startoftext|>`
# and `<|endoftext|>` alternatives cannot match), with its classes spelled out: the letters
# and numbers of ASCII are [a-z] and [0-9], and its whitespace (Oniguruma's \s) is \t \n \v
# \f \r and space; not Python's \s, which also holds \x1c-\x1f. Python's `re` tries the
# alternatives in the same order as Oniguruma, so it cuts the same pieces.
_ASCII_PIECES = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[a-z]+|[0-9]|[^\t\n\x0b\x0c\r a-z0-9]+")
# Piece -> ids, shared by every call in the process. BPE encodes each piece on its own, so a
# caption's ids are its pieces' ids in order. Replaced by an empty dict when full.
_PIECE_IDS: dict[str, tuple[int, ...]] = {}
_PIECE_CACHE_SIZE = 250_000  # about 50 MB


def _piece_ids(pieces_per_caption: list[list[str]]) -> dict[str, tuple[int, ...]]:
    """A piece -> ids dict holding every piece given, new ones encoded in one batch."""
    global _PIECE_IDS
    cache = _PIECE_IDS
    needed = {p for pieces in pieces_per_caption for p in pieces}
    missing = [p for p in needed if p not in cache]
    if missing:
        if len(cache) + len(missing) > _PIECE_CACHE_SIZE:
            cache = _PIECE_IDS = {}  # other threads keep the dict they hold
            missing = list(needed)
        encoder = _fast_tokenizers()[1]
        encodings = encoder.encode_batch_fast(missing, add_special_tokens=False)
        for piece, encoding in zip(missing, encodings, strict=True):
            cache[piece] = tuple(encoding.ids)
    return cache


def encode_captions(captions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """SD1 CLIP ids [N, 77] int32, and each caption's token count [N] before truncation.

    Row layout: BOS 49406, the first 75 caption tokens, EOS 49407, padded with EOS; a caption
    whose count is over 75 was truncated. Ids equal `build_tokenizer()(captions,
    padding="max_length", truncation=True, max_length=77)`. ASCII captions without `<|` (most
    web captions) are lowercased, cut into pieces in Python and looked up in a piece cache;
    the others go through the reference's Rust pipeline in one batch, on the `tokenizers`
    thread pool (RAYON_NUM_THREADS; TOKENIZERS_PARALLELISM=false: one thread).
    """
    general = _fast_tokenizers()[0]
    n = len(captions)
    ids = np.full((n, MAX_TOKENS), EOS_ID, np.int32)
    ids[:, 0] = BOS_ID
    counts = np.zeros(n, np.int64)
    ascii_rows, ascii_pieces, other_rows, other_texts = [], [], [], []
    for i, text in enumerate(captions):
        if text.isascii() and "<|" not in text:
            ascii_rows.append(i)
            ascii_pieces.append(_ASCII_PIECES.findall(text.lower()))
        else:
            other_rows.append(i)
            other_texts.append(text)
    body = MAX_TOKENS - 2

    def put(i: int, tokens: list[int]) -> None:
        counts[i] = len(tokens)
        tokens = tokens[:body]
        ids[i, 1 : 1 + len(tokens)] = tokens

    if ascii_rows:
        lookup = _piece_ids(ascii_pieces).__getitem__
        for i, pieces in zip(ascii_rows, ascii_pieces, strict=True):
            put(i, list(itertools.chain.from_iterable(map(lookup, pieces))))
    if other_rows:
        encodings = general.encode_batch_fast(other_texts, add_special_tokens=False)
        for i, encoding in zip(other_rows, encodings, strict=True):
            put(i, encoding.ids)
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
