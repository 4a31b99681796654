"""tokenize: the ids are SD1's CLIP ids (BOS, caption, EOS, padded with EOS, 77 long)."""

from __future__ import annotations

import html
import unicodedata

import ftfy
import numpy as np
import open_clip
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from open_clip.tokenizer import SimpleTokenizer
from transformers import CLIPTokenizer

from tasks.tokenize import tokenize_shard, tokens_table

BOS, EOS, LENGTH = 49406, 49407, 77

SPECIAL_CASES = [
    "a photo of a cat",
    "A RED Circle Above Green Grass",
    "Ünïcödé café naïve façade",
    "e\u0301 written decomposed",  # NFD: normalized to NFC like the composed form
    "emoji 🐱🚀👍🏽 and a flag 🇫🇷",
    "日本語のキャプション、東京の夜景",
    "Ελληνικά και русский текст",
    "عربي نص مع أرقام ١٢٣",
    "don't WON'T it's we've they'll I'd I'm",
    "Ça va? Ça va! ¿Qué tal?",
    "İstanbul straße ß",
    "tab\tand\nnewline  and   spaces",
    "1234567890 3.14159 1,000,000",
    "punctuation!!! ... ??? --- (brackets) [and] {braces}",
    "zero\u200bwidth space",
    "a " + "very " * 100 + "long caption",
    "x" * 400,
    "🐱" * 120,
    " ".join(str(i) for i in range(200)),
]
WORDS = [
    "a",
    "photo",
    "of",
    "the",
    "red",
    "circle",
    "über",
    "naïve",
    "東京",
    "🚀",
    "cat's",
    "sunset,",
    "4k",
    "HDR",
    "portrait",
    "by",
    "artist",
    "—",
    "ñandú",
    "(detailed)",
]


def captions() -> list[str]:
    """~200 captions: the special cases above plus seeded random mixes of WORDS."""
    rng = np.random.default_rng(0)
    mixed = [
        " ".join(rng.choice(WORDS, size=int(rng.integers(1, 90))))
        for _ in range(200 - len(SPECIAL_CASES))
    ]
    return SPECIAL_CASES + mixed


@pytest.fixture(scope="module")
def reference_tokenizer() -> CLIPTokenizer:
    """A transformers CLIPTokenizer with CLIP's vocabulary and merges, as SD1 configures it.

    Vocabulary and merge ranks are taken from open_clip's copy of OpenAI's tokenizer (its
    special tokens renamed to the `<|...|>` spelling that transformers and SD1 use).
    """
    clip = SimpleTokenizer()
    rename = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {rename.get(token, token): i for token, i in clip.encoder.items()}
    merges = [pair for pair, _ in sorted(clip.bpe_ranks.items(), key=lambda kv: kv[1])]
    return CLIPTokenizer(
        vocab=vocab, merges=merges, pad_token="<|endoftext|>", model_max_length=LENGTH
    )


def ids_of(captions: list[str]) -> np.ndarray:
    table = tokens_table([f"{i:05d}" for i in range(len(captions))], captions)
    return np.array(table["input_ids"].to_pylist())


def test_ids_equal_sd1_clip_tokenizer(reference_tokenizer):
    texts = captions()
    ids = ids_of(texts)
    expected = reference_tokenizer(texts, padding="max_length", truncation=True, max_length=LENGTH)[
        "input_ids"
    ]
    assert ids.shape == (len(texts), LENGTH)
    for text, got, want in zip(texts, ids, expected, strict=True):
        assert got.tolist() == want, text


def test_layout_is_bos_caption_eos_then_eos_padding():
    ids = ids_of(["a photo of a cat", "x" * 400])
    short, long = ids
    end = short.tolist().index(EOS)
    assert short[0] == BOS
    assert 1 < end < LENGTH - 1
    assert (short[end:] == EOS).all()
    # A caption longer than 77 ids is truncated and still ends in EOS.
    assert long[0] == BOS and long[-1] == EOS
    assert EOS not in long[1:-1]


def open_clip_cleaning_is_neutral(text: str) -> bool:
    """True when open_clip's extra cleaning (ftfy, HTML unescape) leaves the caption unchanged.

    The transformers tokenizer normalizes with NFC + whitespace + lowercase only; captions
    with HTML entities, curly quotes, ligatures or full-width letters are cleaned differently.
    """
    cleaned = ftfy.fix_text(html.unescape(html.unescape(text)))
    return " ".join(cleaned.split()) == " ".join(unicodedata.normalize("NFC", text).split())


def test_ids_equal_open_clip_up_to_the_first_eos():
    texts = [t for t in captions() if open_clip_cleaning_is_neutral(t)]
    assert len(texts) >= 180  # the comparison covers nearly every caption
    ids = ids_of(texts)
    reference = open_clip.tokenize(texts).numpy()  # pads with 0 after EOS
    for text, got, want in zip(texts, ids, reference, strict=True):
        end = want.tolist().index(EOS)
        assert got[: end + 1].tolist() == want[: end + 1].tolist(), text
    truncated = reference[:, -1] == EOS
    assert truncated.sum() >= 3  # the very long captions are among them
    assert (ids[truncated, -1] == EOS).all()


def test_tokenize_shard_drops_empty_captions_and_keeps_order(tmp_path):
    source = "src"
    rows = [
        ("k0", "a cat"),
        ("k1", None),
        ("k2", "   "),
        ("k3", "  a dog \n"),
        ("k4", ""),
        ("k5", "\t\n"),
        ("k6", "日本語 🐱"),
    ]
    (tmp_path / source / "selected").mkdir(parents=True)
    pq.write_table(
        pa.table({"key": [k for k, _ in rows], "caption": [c for _, c in rows]}),
        tmp_path / source / "selected" / "00000.parquet",
    )
    stats = tokenize_shard(tmp_path, source, "00000")
    assert stats.dropped == {"empty_caption": 4}
    assert (stats.num_in, stats.num_out) == (7, 3)

    table = pq.read_table(tmp_path / source / "tokens" / "00000.parquet")
    assert table["key"].to_pylist() == ["k0", "k3", "k6"]
    assert table.schema.field("input_ids").type == pa.list_(pa.int32(), LENGTH)
    assert table["input_ids"].to_pylist() == ids_of(["a cat", "a dog", "日本語 🐱"]).tolist()


def test_tokenize_shard_with_no_captions_writes_an_empty_table(tmp_path):
    (tmp_path / "src" / "selected").mkdir(parents=True)
    pq.write_table(
        pa.table({"key": pa.array([], pa.string()), "caption": pa.array([], pa.string())}),
        tmp_path / "src" / "selected" / "00000.parquet",
    )
    stats = tokenize_shard(tmp_path, "src", "00000")
    table = pq.read_table(tmp_path / "src" / "tokens" / "00000.parquet")
    assert (stats.num_in, stats.num_out, table.num_rows) == (0, 0, 0)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32(), LENGTH)
