"""tokenize: the ids are SD1's CLIP ids (BOS, caption, EOS, padded with EOS, 77 long)."""

from __future__ import annotations

import html
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import ftfy
import numpy as np
import open_clip
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer
from transformers import CLIPTokenizer

from sdtrain import models
from sdtrain.models import encode_captions, tokenize
from tasks.latents.tokenize import clean_caption, tokenize_shard, tokens_table
from tasks.runtime.shards import ShardStats

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
    # What web captions hold, and what the fast path must get right:
    "Tom &amp; Jerry &lt;3 &#39;quoted&#39; &quot;x&quot; &nbsp;",
    "family 👨\u200d👩\u200d👧\u200d👦 rainbow 🏳️\u200d🌈 keycap 1️⃣ skin 👋🏿",
    "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307lgo combining",
    "ΟΔΟΣ ΣΙΣΥΦΟΣ Σ",  # final sigma: lowercased per character, not as Python's lower()
    "İI ı ǅ ǈ ǋ ŉ ﬁ ﬂ ẞ",  # case mappings that expand or differ by language
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３",
    "“curly” ‘single’ it’s don’t",
    "mixed\r\n\x0b\x0cwhitespace\u00a0nbsp\u3000ideographic\u2028line\u0085next",
    "controls \x00\x01\x1c\x1d\x1e\x1f\x7f end",
    "\ufeffbom and \u200c\u200d joiners \ufe0f",
    "'S 'T 'RE 'VE 'M 'LL 'D don'T IT'S '''s ''' 'x",
    "<|endoftext|> inside, <|startoftext|> too",
    "<|ENDOFTEXT|> <|StartOfText|> <| endoftext |> <|endoftext",
    "#hashtags #art @user https://example.com/a?b=c&d=e_f-g.html",
    "100% $5.99 £3 €4 ¥5 ½ ² ³ ① Ⅻ ٣ ௫ 𝟙",
    "नमस्ते दुनिया สวัสดีครับ 안녕하세요 שלום עולם",
    "A" * 300,
    "a " * 75,  # exactly 75 caption tokens: fits
    "a " * 76,  # one over: truncated
    "é " * 76,
    "....!!!!????,,,,;;;;::::----____****~~~~^^^^",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "   leading and trailing   ",
    "\t",
    "",
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
# Words that open_clip cleans or splits differently (HTML entities, special tokens, ...).
HARD_WORDS = [
    "&amp;",
    "👩\u200d💻",
    "e\u0301",
    "ΣΟΦΊΑ",
    "WON'T",
    "\t\n",
    "3.5mm",
    "«quoted»",
    "Ⅷ",
    "<|endoftext|>",
]
# Characters the random strings are drawn from: every ASCII character, Unicode whitespace,
# Latin-1, combining marks, several scripts, emoji with joiners and selectors.
FUZZ_CHARS = (
    [chr(c) for c in range(128)] * 3
    + list("\u0085\u00a0\u1680\u2000\u2009\u200a\u200b\u2028\u2029\u202f\u205f\u3000")
    + [chr(c) for c in range(0xA1, 0x180)]
    + [chr(c) for c in range(0x300, 0x370)]
    + list("ΑαΣσςΟοДдЖжİıǅﬁẞ日本語東京中文한국어नमस्तेสวัสดีשלוםعربي١٢٣")
    + list("🐱🚀👍🏽🇫🇷👨👩👧\u200d\u200c\ufe0f\ufeff⃣Ｆｕ１＜｜")
    + ["<|", "|>", "<|endoftext|>", "<|startoftext|>", "<|ENDOFTEXT|>", "<|StartOfText|>"]
    + ["'s", "'T", "&amp;", "&#39;"]
)


def captions(hard_words: bool = True) -> list[str]:
    """300 captions: the special cases above plus seeded random mixes of words (half ASCII)."""
    rng = np.random.default_rng(0)
    words = WORDS + HARD_WORDS if hard_words else WORDS
    ascii_words = [w for w in words if w.isascii() and "<|" not in w]
    mixed = [
        " ".join(rng.choice(words if i % 2 else ascii_words, size=int(rng.integers(1, 90))))
        for i in range(300 - len(SPECIAL_CASES))
    ]
    return SPECIAL_CASES + mixed


def random_strings(n: int, seed: int = 1) -> list[str]:
    """Seeded random strings of FUZZ_CHARS, 0 to 120 draws long; every third ASCII only."""
    rng = np.random.default_rng(seed)
    ascii_chars = [c for c in FUZZ_CHARS if c.isascii()]
    out = []
    for i in range(n):
        pool = ascii_chars if i % 3 == 0 else FUZZ_CHARS
        out.append("".join(rng.choice(pool, size=int(rng.integers(0, 120)))))
    return out


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


def reference_ids(tokenizer: CLIPTokenizer, texts: list[str]) -> list[list[int]]:
    out = tokenizer(texts, padding="max_length", truncation=True, max_length=LENGTH)
    return out["input_ids"]


def ids_of(captions: list[str]) -> np.ndarray:
    table = tokens_table([f"{i:05d}" for i in range(len(captions))], captions)
    return np.array(table["input_ids"].to_pylist())


def test_ids_equal_sd1_clip_tokenizer(reference_tokenizer):
    texts = captions()
    ids = ids_of(texts)
    expected = reference_ids(reference_tokenizer, texts)
    assert ids.shape == (len(texts), LENGTH)
    for text, got, want in zip(texts, ids, expected, strict=True):
        assert got.tolist() == want, repr(text)
    # Both ways through encode_captions are covered: ASCII without `<|`, and the rest.
    ascii_only = [t for t in texts if t.isascii() and "<|" not in t]
    assert 50 < len(ascii_only) < len(texts) - 100


def test_ids_and_counts_equal_sd1_clip_tokenizer_on_random_strings(reference_tokenizer):
    texts = random_strings(3000)
    ids, counts = encode_captions(texts)
    expected = reference_ids(reference_tokenizer, texts)
    unpadded = reference_tokenizer(texts, add_special_tokens=False)["input_ids"]
    for text, got, want, count, full in zip(texts, ids, expected, counts, unpadded, strict=True):
        assert got.tolist() == want, repr(text)
        assert count == len(full), repr(text)
    assert (counts > LENGTH - 2).sum() > 100  # truncation is exercised both ways too


def test_counts_tell_truncated_captions():
    ids, counts = encode_captions(["a " * 75, "a " * 76, "", "a photo", "x" * 400])
    assert counts.tolist()[:4] == [75, 76, 0, 2]
    assert (counts > LENGTH - 2).tolist() == [False, True, False, False, True]
    assert ids.dtype == np.int32
    assert ids[0, -1] == EOS and ids[0, -2] != EOS  # 75 tokens: EOS is the last id
    assert ids[1].tolist() == ids[0].tolist()
    assert ids[2].tolist() == [BOS] + [EOS] * (LENGTH - 1)


def test_piece_cache_stays_bounded_and_right_under_threads(monkeypatch):
    """A full piece cache is replaced while other threads still read the one they hold."""
    texts = [t for t in captions() + random_strings(600) if t.isascii()]
    expected = encode_captions(texts)[0]
    monkeypatch.setattr(models, "_PIECE_CACHE_SIZE", 50)
    monkeypatch.setattr(models, "_PIECE_IDS", {})
    chunks = [texts[i::4] for i in range(4)] * 5
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda chunk: encode_captions(chunk)[0], chunks))
    for i, got in enumerate(results):
        assert (got == expected[i % 4 :: 4]).all()
    assert len(models._PIECE_IDS) < 50 + len({p for t in texts for p in t.split()}) * 4


def test_sdtrain_tokenize_gives_the_same_ids_as_int64(reference_tokenizer):
    texts = captions()[:60]
    out = tokenize(texts)
    assert out.dtype == torch.int64 and out.shape == (len(texts), LENGTH)
    assert out.tolist() == reference_ids(reference_tokenizer, texts)


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
    # open_clip has no special tokens in text, splits on Python's whitespace (not \s) and
    # lowercases a final sigma to ς (transformers lowercases each character on its own).
    texts = [
        t
        for t in captions(hard_words=False)
        if open_clip_cleaning_is_neutral(t) and not any(c in t for c in ("<|", "\x1c", "Σ"))
    ]
    assert len(texts) >= 250  # the comparison covers nearly every caption
    ids = ids_of(texts)
    reference = open_clip.tokenize(texts).numpy()  # pads with 0 after EOS
    for text, got, want in zip(texts, ids, reference, strict=True):
        end = want.tolist().index(EOS)
        assert got[: end + 1].tolist() == want[: end + 1].tolist(), text
    truncated = reference[:, -1] == EOS
    assert truncated.sum() >= 3  # the very long captions are among them
    assert (ids[truncated, -1] == EOS).all()


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("a cat", ("a cat", None)),
        ("  a dog \n", ("a dog", None)),
        (b"caf\xc3\xa9 \xf0\x9f\x90\xb1", ("café 🐱", None)),
        (bytearray(b" x "), ("x", None)),
        (None, (None, "empty_caption")),
        ("", (None, "empty_caption")),
        (" \t\n\u3000\u00a0", (None, "empty_caption")),
        (b"   ", (None, "empty_caption")),
        (b"caf\xe9", (None, "caption_encoding")),  # Latin-1, not UTF-8
        (b"\xff\xfe", (None, "caption_encoding")),
        (b"\xed\xa0\x80", (None, "caption_encoding")),  # an encoded surrogate
        (b"ab\xf0\x9f", (None, "caption_encoding")),  # truncated sequence
        ("caf\udce9", (None, "caption_encoding")),  # surrogateescape leftovers
        ("\u200b", ("\u200b", None)),  # not whitespace to Python: a caption, one token
    ],
)
def test_clean_caption(raw, expected):
    assert clean_caption(raw) == expected


def write_selected(root, source: str, keys: list[str], captions: pa.Array) -> None:
    (root / source / "selected").mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({"key": pa.array(keys, pa.string()), "caption": captions}),
        root / source / "selected" / "00000.parquet",
    )


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
    write_selected(tmp_path, source, [k for k, _ in rows], pa.array([c for _, c in rows]))
    stats = tokenize_shard(tmp_path, source, "00000")
    assert stats.dropped == {"empty_caption": 4}
    assert (stats.num_in, stats.num_out) == (7, 3)
    assert stats.extra == {"truncated": 0}

    table = pq.read_table(tmp_path / source / "tokens" / "00000.parquet")
    assert table["key"].to_pylist() == ["k0", "k3", "k6"]
    assert table.schema.field("input_ids").type == pa.list_(pa.int32(), LENGTH)
    assert table["input_ids"].to_pylist() == ids_of(["a cat", "a dog", "日本語 🐱"]).tolist()


def test_tokenize_shard_counts_bad_captions_and_goes_on(tmp_path, reference_tokenizer):
    """Binary captions (as an adapter might leave them): each bad one is counted, none lost."""
    raw = [b"ok", b"caf\xe9", b"", None, ("long " * 100).encode(), "日本".encode(), b"\xff"]
    keys = [f"k{i}" for i in range(len(raw))]
    write_selected(tmp_path, "src", keys, pa.array(raw, pa.binary()))
    stats = tokenize_shard(tmp_path, "src", "00000")
    assert stats.dropped == {"caption_encoding": 2, "empty_caption": 2}
    assert (stats.num_in, stats.num_out) == (7, 3)
    assert stats.extra == {"truncated": 1}
    record = ShardStats.read(tmp_path / "src" / "tokens" / "00000.stats.json")
    assert record.extra == {"truncated": 1}
    table = pq.read_table(tmp_path / "src" / "tokens" / "00000.parquet")
    assert table["key"].to_pylist() == ["k0", "k4", "k5"]
    texts = ["ok", ("long " * 100).strip(), "日本"]
    assert table["input_ids"].to_pylist() == reference_ids(reference_tokenizer, texts)


def test_tokenize_shard_with_no_captions_writes_an_empty_table(tmp_path):
    write_selected(tmp_path, "src", [], pa.array([], pa.string()))
    stats = tokenize_shard(tmp_path, "src", "00000")
    table = pq.read_table(tmp_path / "src" / "tokens" / "00000.parquet")
    assert (stats.num_in, stats.num_out, table.num_rows) == (0, 0, 0)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32(), LENGTH)


def test_tokens_keep_the_cleaned_caption_and_the_sample_tables_captions(tmp_path):
    """Train-time captions read the text back from the tokens file: `caption` always, and
    `captions` (cleaned, in order) where the shard's sample table lists several (COCO)."""
    write_selected(tmp_path, "src", ["k0", "k1", "k2", "k3"], pa.array([" a", "", "b ", "c"]))
    stats = tokenize_shard(tmp_path, "src", "00000")
    table = pq.read_table(tmp_path / "src" / "tokens" / "00000.parquet")
    assert table.column_names == ["key", "input_ids", "caption"]
    assert table["caption"].to_pylist() == ["a", "b", "c"]
    assert table["input_ids"].to_pylist() == ids_of(["a", "b", "c"]).tolist()
    assert stats.dropped == {"empty_caption": 1}

    shards = tmp_path / "coco" / "shards"
    shards.mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "key": ["k2", "k0", "k1", "k3"],  # another order: joined by key
                "caption": ["b", "a", "", "c"],
                "captions": [["b ", "b2", "  "], [" a", None, "a2"], [""], None],
            }
        ),
        shards / "00000.parquet",
    )
    write_selected(tmp_path, "coco", ["k0", "k1", "k2", "k3"], pa.array([" a", "", "b ", "c"]))
    tokenize_shard(tmp_path, "coco", "00000")
    table = pq.read_table(tmp_path / "coco" / "tokens" / "00000.parquet")
    assert table.column_names == ["key", "input_ids", "caption", "captions"]
    assert table["captions"].to_pylist() == [["a", "a2"], ["b", "b2"], ["c"]]  # k3: none listed
    ids = np.load(tmp_path / "coco" / "tokens" / "00000.npy")
    assert ids.tolist() == ids_of(["a", "b", "c"]).tolist()  # the .npy as before
