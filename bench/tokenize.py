"""Tokenize throughput: SD1 CLIP ids for a LAION-like caption mix, fast path vs the reference.

The production path is `sdtrain.models.encode_captions` (what the tokenize stage and the
trainer use); the reference is the transformers `CLIPTokenizer` called as SD1 calls it (what
the stage called before). Each is timed on all threads of the `tokenizers` pool here, and, in
a child process with RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false, on one thread: the
per-core figure, counted per CPU second of the process (on a shared machine a wall-clock
rate measures the share of a core the process got; the one-thread wall rate is printed too).
Runs alternate fast/reference; the first fast run starts with an empty piece cache (`_cold_cache`
figures), the median of the other runs is reported. `tokenize_shard` is timed end to end
(parquet in, clean, encode, parquet out) too.

Captions: word counts log-normal (median 9, like LAION-2B-en's English captions); 30%
function words, the rest Zipf-drawn from the whole words of CLIP's vocabulary (merge order as
frequency), with title/upper case, numbers, sizes, SKU-like codes, separators, and non-ASCII
in ~15% of captions (accents, curly quotes, emoji, CJK); under 1% run over 77 tokens.
Prints one JSON object.
Usage: python bench/tokenize.py [--captions N] [--repeats R]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where this file would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

import numpy as np

NON_ASCII = [
    "café",
    "naïve",
    "“quoted”",
    "it’s",
    "–",
    "©",
    "°",
    "€",
    "🐱",
    "❤️",
    "👍🏽",
    "東京",
    "москва",
    "Ç",
    "ß",
    "½",
]
FUNCTION_WORDS = ["a", "the", "of", "and", "in", "with", "on", "for", "to", "by", "at", "is"]
SEPARATORS = [",", "-", "|", ":", ".", "/", "(", ")", "&", "#", "!", "'s"]


def laion_like_captions(n: int, seed: int = 0) -> list[str]:
    from open_clip.tokenizer import SimpleTokenizer

    # Whole ASCII words of 3+ letters in merge order, which roughly follows their frequency
    # in CLIP's training text; short function words are drawn separately.
    words = [
        w[:-4]
        for w in SimpleTokenizer().encoder
        if w.endswith("</w>") and w[:-4].isascii() and w[:-4].isalpha() and len(w) >= 7
    ]
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, len(words) + 1) ** 1.05
    zipf /= zipf.sum()
    lengths = np.clip(np.round(rng.lognormal(np.log(9), 0.75, n)), 1, 200).astype(int)
    out = []
    for length in lengths:
        picks = [
            str(rng.choice(FUNCTION_WORDS)) if rng.random() < 0.3 else words[i]
            for i in rng.choice(len(words), size=length, p=zipf)
        ]
        caption = []
        for w in picks:
            r = rng.random()
            if r < 0.25:
                w = w.title()
            elif r < 0.28:
                w = w.upper()
            elif r < 0.31:
                w = str(int(rng.integers(0, 3000)))
            elif r < 0.32:
                w = f"{rng.integers(100, 4000)}x{rng.integers(100, 4000)}"
            elif r < 0.33:
                w = "".join(rng.choice(list("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"), 10))
            caption.append(w)
            if rng.random() < 0.08:
                caption.append(str(rng.choice(SEPARATORS)))
        if rng.random() < 0.15:
            caption.insert(int(rng.integers(0, len(caption) + 1)), str(rng.choice(NON_ASCII)))
        out.append(" ".join(caption))
    return out


def reference(captions: list[str]) -> np.ndarray:
    from sdtrain.models import build_tokenizer

    out = build_tokenizer()(
        captions, padding="max_length", truncation=True, max_length=77, return_tensors="np"
    )
    return out["input_ids"]


def timed(fn, captions: list[str]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn(captions)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(captions: list[str], reference_captions: list[str], repeats: int) -> dict:
    """Median captions per wall second and per CPU second, fast path and reference."""
    from sdtrain.models import encode_captions

    encode_captions(["a"])  # build the tokenizers outside the timings; the piece cache
    reference(reference_captions[:100])  # stays cold until the first run
    runs = {"fast": [], "fast_cpu": [], "reference": [], "reference_cpu": []}
    for _ in range(repeats + 1):
        for name, fn, texts in (
            ("fast", encode_captions, captions),
            ("reference", reference, reference_captions),
        ):
            wall, cpu = timed(fn, texts)
            runs[name].append(len(texts) / wall)
            runs[f"{name}_cpu"].append(len(texts) / cpu)
    out = {k: round(statistics.median(v[1:])) for k, v in runs.items()}
    out["fast_cold"] = round(runs["fast"][0])
    out["fast_cpu_cold"] = round(runs["fast_cpu"][0])
    out["runs"] = [round(x) for x in runs["fast"]]
    return out


def measure_shard(captions: list[str], repeats: int) -> float:
    """tokenize_shard end to end on one shard of these captions (median captions/s)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.latents.tokenize import tokenize_shard

    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "src" / "selected").mkdir(parents=True)
        keys = [f"{i:09d}" for i in range(len(captions))]
        pq.write_table(
            pa.table({"key": keys, "caption": captions}),
            root / "src" / "selected" / "00000.parquet",
        )
        for r in range(repeats):
            for p in (root / "src" / "tokens").glob("00000.*"):
                p.unlink()
            start = time.perf_counter()
            stats = tokenize_shard(root, "src", "00000")
            rates.append(len(captions) / (time.perf_counter() - start))
            assert stats.num_in == len(captions) and not stats.skipped, r
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--captions", type=int, default=50_000)
    parser.add_argument("--reference-captions", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # child
    args = parser.parse_args()

    captions = laion_like_captions(args.captions)
    reference_captions = captions[: args.reference_captions]
    if args.single:
        print(json.dumps(measure(captions, reference_captions, args.repeats)))
        return

    load_before = os.getloadavg()[0]
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    child = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--single", *sys.argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    one = json.loads(child.stdout.strip().splitlines()[-1])
    from sdtrain.models import encode_captions

    many = measure(captions, reference_captions, args.repeats)
    shard = measure_shard(captions, max(1, args.repeats // 2))

    import torch

    ids, counts = encode_captions(captions)
    ref = reference(reference_captions)
    threads = os.environ.get("RAYON_NUM_THREADS") or str(os.cpu_count())
    print(
        json.dumps(
            {
                "bench": "tokenize",
                "captions": args.captions,
                "reference_captions": args.reference_captions,
                "repeats": args.repeats,
                "mean_tokens": round(float(np.minimum(counts, 75).mean()) + 2, 1),
                "truncated_fraction": round(float((counts > 75).mean()), 4),
                "non_ascii_fraction": round(np.mean([not c.isascii() for c in captions]), 3),
                "ids_equal_reference": bool((ids[: len(ref)] == ref).all()),
                "captions_per_s": many["fast"],
                "captions_per_s_per_core": one["fast_cpu"],
                "captions_per_s_one_thread_wall": one["fast"],
                "captions_per_s_cold_cache": many["fast_cold"],
                "captions_per_s_per_core_cold_cache": one["fast_cpu_cold"],
                "captions_per_cpu_s_all_threads": many["fast_cpu"],
                "reference_captions_per_s": many["reference"],
                "reference_captions_per_s_per_core": one["reference_cpu"],
                "speedup_vs_slow": round(many["fast"] / many["reference"], 1),
                "speedup_vs_slow_per_core": round(one["fast_cpu"] / one["reference_cpu"], 1),
                "tokenize_shard_captions_per_s": round(shard),
                "runs_captions_per_s": many["runs"],
                "runs_captions_per_s_one_thread_wall": one["runs"],
                "threads": f"tokenizers {threads}, per core 1; torch {torch.get_num_threads()}",
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }
        )
    )


if __name__ == "__main__":
    main()
