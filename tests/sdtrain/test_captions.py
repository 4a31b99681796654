"""Captions at train time: mix writes captions.arrow from the tokens files (or, for shards
tokenized before, the sample tables), and the loader's captions are drawn and tag-augmented
per (seed, epoch, row) and tokenized exactly as the tokenize stage tokenizes."""

from __future__ import annotations

import pickle
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sdtrain import captions as cap
from sdtrain import layout
from sdtrain.captions import CaptionSettings, TrainTimeCaptions, write_captions
from tasks.latents.tokenize import tokens_table
from tasks.phases import mix
from tests.tasks.phases.test_mix import (
    SIZES,
    MixEntry,
    catalog,
    phase,
    views,  # noqa: F401 (the fixture mix draws from)
)

TAGS = "scr800, solo, pony, blue eyes, smiling, outdoors, tree, sky, grass, flowers"


def write_phase(folder: Path, rows: list[list[str]]) -> Path:
    """A phase set by hand: one tokens file with a `captions` column, row i = manifest row i."""
    (folder / "tokens").mkdir(parents=True)
    table = pa.table(
        {
            "key": [f"k{i}" for i in range(len(rows))],
            "caption": [r[0] for r in rows],
            "captions": pa.array(rows, pa.list_(pa.string())),
        }
    )
    pq.write_table(table, folder / "tokens" / "s-00000.parquet")
    index = np.zeros((len(rows), 3), np.int32)
    index[:, 2] = np.arange(len(rows))
    write_captions(folder, (["s-00000"], index), folder)
    return folder


@pytest.fixture
def tagged(tmp_path) -> Path:
    return write_phase(tmp_path / "phase", [[TAGS], ["a cat", "a small cat", "cat on a mat"]])


def test_without_augmentation_the_ids_are_the_tokenize_stages(tagged):
    captions = TrainTimeCaptions(tagged, CaptionSettings(), seed=0)
    assert len(captions) == 2
    assert captions.caption(0, 0) == captions.caption(0, 5) == TAGS
    stored = tokens_table(["k0"], [TAGS])["input_ids"].to_pylist()[0]
    assert captions.ids(0, 3).dtype == np.int32 and captions.ids(0, 3).tolist() == stored
    batch = captions.ids_batch([1, 0, 1], 2)
    assert batch.shape == (3, 77)
    assert batch[1].tolist() == stored and batch[0].tolist() == captions.ids(1, 2).tolist()


def test_tag_shuffle_keeps_the_first_keep_tokens_in_place(tagged):
    settings = CaptionSettings(shuffle_tags_p=1.0, keep_tokens=2)
    captions = TrainTimeCaptions(tagged, settings, seed=7)
    tags = TAGS.split(", ")
    seen = set()
    for epoch in range(30):
        drawn = captions.caption(0, epoch).split(", ")
        assert drawn[:2] == ["scr800", "solo"]
        assert sorted(drawn[2:]) == sorted(tags[2:])  # shuffled, none lost
        seen.add(tuple(drawn))
    assert len(seen) > 20  # 8! orders: epochs differ
    # The draw is a function of (seed, epoch, row): another instance, another process, the same.
    again = pickle.loads(pickle.dumps(TrainTimeCaptions(tagged, settings, seed=7)))
    assert [again.caption(0, e) for e in range(5)] == [captions.caption(0, e) for e in range(5)]
    other_seed = TrainTimeCaptions(tagged, settings, seed=8)
    assert [other_seed.caption(0, e) for e in range(5)] != [
        captions.caption(0, e) for e in range(5)
    ]
    # shuffle_tags_p: about that share of the epochs is shuffled.
    half = TrainTimeCaptions(tagged, CaptionSettings(shuffle_tags_p=0.5, keep_tokens=1), seed=0)
    shuffled = sum(half.caption(0, e) != TAGS for e in range(400))
    assert 150 < shuffled < 250


def test_tag_dropout_never_drops_the_kept_tokens(tagged):
    tags = TAGS.split(", ")
    captions = TrainTimeCaptions(tagged, CaptionSettings(keep_tokens=1, tag_dropout=0.5), seed=0)
    lengths = []
    for epoch in range(200):
        drawn = captions.caption(0, epoch).split(", ")
        assert drawn[0] == "scr800"
        assert drawn == [t for t in tags if t in drawn]  # no shuffle: the order is kept
        lengths.append(len(drawn) - 1)
    assert 3.5 < np.mean(lengths) < 5.5  # 9 tags, each kept with probability 0.5
    everything = TrainTimeCaptions(tagged, CaptionSettings(keep_tokens=2, tag_dropout=1.0))
    assert everything.caption(0, 0) == "scr800, solo"


def test_one_caption_of_several_per_epoch_and_all_of_them_over_epochs(tagged):
    captions = TrainTimeCaptions(tagged, CaptionSettings(), seed=3)
    drawn = Counter(captions.caption(1, epoch) for epoch in range(60))
    assert set(drawn) == {"a cat", "a small cat", "cat on a mat"}  # each drawn whole
    assert min(drawn.values()) > 5
    assert captions.caption(1, 4) == TrainTimeCaptions(tagged, seed=3).caption(1, 4)
    with pytest.raises(IndexError):
        captions.caption(2, 0)


def test_write_captions_takes_each_rows_captions_in_manifest_order(tmp_path, monkeypatch):
    """Three files: one with `captions`, one with `caption` only, and one tokenized before
    tokenize kept text (read from its shard's sample table by key); rows interleaved and cut
    into several record batches."""
    monkeypatch.setattr(cap, "BATCH_ROWS", 4)
    root = tmp_path / "data"
    phase_dir = root / "phases" / "p"
    (phase_dir / "tokens").mkdir(parents=True)
    listed = pa.table({"key": ["a0", "a1"], "captions": [["x", "y"], ["z"]]})
    pq.write_table(listed, phase_dir / "tokens" / "a-00000.parquet")
    pq.write_table(tokens_table(["b0", "b1", "b2"], ["b zero", "b one", "b two"]),
                   phase_dir / "tokens" / "b-00000.parquet")  # fmt: skip
    (root / "old" / "tokens").mkdir(parents=True)
    (root / "old" / "shards").mkdir(parents=True)
    old = tokens_table(["o0", "o1"], ["?", "?"]).select(["key", "input_ids"])
    pq.write_table(old, root / "old" / "tokens" / "00000.parquet")
    (phase_dir / "tokens" / "old-00000.256x512.parquet").symlink_to(
        Path("../../../old/tokens/00000.parquet")
    )
    samples = {
        "key": ["o1", "gone", "o0"],
        "caption": ["  old one ", "x", "old zero"],
        "captions": [None, ["x"], [" old zero ", "old 0"]],
    }
    pq.write_table(pa.table(samples), root / "old" / "shards" / "00000.parquet")
    files = ["a-00000", "b-00000", "old-00000.256x512"]
    rows = np.array(
        [[1, 0, 2], [0, 0, 1], [2, 0, 0], [1, 0, 0], [0, 0, 0], [2, 0, 1], [1, 0, 1], [1, 0, 2]],
        np.int32,
    )
    write_captions(phase_dir, (files, rows), root)
    table = pa.ipc.open_file(pa.memory_map(str(phase_dir / "captions.arrow"))).read_all()
    assert table.schema == cap.SCHEMA
    assert table["captions"].num_chunks == 2
    assert table["captions"].to_pylist() == [
        ["b two"], ["z"], ["old zero", "old 0"], ["b zero"],
        ["x", "y"], ["old one"], ["b one"], ["b two"],
    ]  # fmt: skip
    assert not list(phase_dir.glob(".*"))  # written under a temp name, then renamed
    # The folder's own index (rows.npy, files.json) is read when none is given.
    pq.write_table(
        pa.table({"key": [str(i) for i in range(len(rows))]}), phase_dir / "manifest.parquet"
    )
    layout.write_index(phase_dir, files, rows)
    (phase_dir / "captions.arrow").unlink()
    write_captions(phase_dir)
    assert TrainTimeCaptions(phase_dir).options(2) == ["old zero", "old 0"]
    assert len(TrainTimeCaptions(phase_dir)) == len(rows)
    # A batch (rows of both record batches, an epoch each) is its rows' captions, one by one.
    captions = TrainTimeCaptions(phase_dir, seed=5)
    batch = captions.captions([7, 0, 5, 2, 4], [1, 2, 3, 4, 5])
    assert batch == [captions.caption(r, e) for r, e in [(7, 1), (0, 2), (5, 3), (2, 4), (4, 5)]]
    assert batch[:3] == ["b two", "b two", "old one"]


@pytest.mark.usefixtures("views")
def test_mix_writes_captions_for_a_phase_that_tokenizes_at_train_time(tmp_path):
    for source in ("a", "b"):
        keys = [f"{source}-{i:04d}" for i in range(SIZES[source])]
        (tmp_path / source / "tokens").mkdir(parents=True)
        table = tokens_table(keys, [f"caption of {k}" for k in keys])
        pq.write_table(table, tmp_path / source / "tokens" / "00000.parquet")
    entries = (MixEntry(dataset="a", count=12), MixEntry(dataset="b", count=9))
    mix.build_phase_set(tmp_path, catalog(tmp_path), phase(*entries))
    assert not (tmp_path / "phases" / "p1" / cap.CAPTIONS).exists()  # the default: stored ids
    mix.build_phase_set(tmp_path, catalog(tmp_path), phase(*entries, train_time_captions=True))
    phase_dir = tmp_path / "phases" / "p1"
    keys = pq.read_table(phase_dir / "manifest.parquet")["key"].to_pylist()
    captions = TrainTimeCaptions(phase_dir)
    assert len(captions) == len(keys) == 21
    assert [captions.caption(i, 0) for i in range(21)] == [f"caption of {k}" for k in keys]
    # A run with checkpoints keeps its set; turning train-time captions on adds their text only.
    (phase_dir / cap.CAPTIONS).unlink()
    (tmp_path / "runs" / "p1" / "checkpoints" / "step-00000010").mkdir(parents=True)
    manifest = (phase_dir / "manifest.parquet").read_bytes()
    report = mix.phase_set_for_run(
        tmp_path, catalog(tmp_path), phase(*entries, train_time_captions=True)
    )
    assert report["reused"] and (phase_dir / "manifest.parquet").read_bytes() == manifest
    assert TrainTimeCaptions(phase_dir).caption(20, 0) == f"caption of {keys[20]}"


def test_tokenizer_throughput(tagged, capsys):
    """Captions per second on one core, augmented (shuffle + dropout), in collate-sized
    batches: what one loader thread tokenizes while the GPU steps."""
    settings = CaptionSettings(shuffle_tags_p=0.5, keep_tokens=1, tag_dropout=0.1)
    captions = TrainTimeCaptions(tagged, settings, seed=0)
    captions.ids_batch([0, 1], 0)  # builds the tokenizer once
    batch, epochs = 64, 40
    started = time.perf_counter()
    for epoch in range(epochs):
        ids = captions.ids_batch(np.arange(batch) % 2, epoch)
    rate = batch * epochs / (time.perf_counter() - started)
    with capsys.disabled():
        print(f"\ntrain-time captions: {rate:,.0f} captions/s on one thread (batch {batch})")
    assert ids.shape == (batch, 77) and rate > 500


def test_loader_threads_share_one_instance(tagged):
    """The file is mapped once, on first use, whichever loader thread gets there first."""
    from concurrent.futures import ThreadPoolExecutor

    settings = CaptionSettings(shuffle_tags_p=0.5, keep_tokens=1, tag_dropout=0.2)
    serial = TrainTimeCaptions(tagged, settings, seed=1)
    expected = [serial.ids_batch([0, 1, 0], epoch).tolist() for epoch in range(16)]
    shared = TrainTimeCaptions(tagged, settings, seed=1)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda e: shared.ids_batch([0, 1, 0], e).tolist(), range(16)))
    assert got == expected


def test_a_phase_set_mixed_without_captions_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"captions.arrow is missing.*mix the phase again"):
        TrainTimeCaptions(tmp_path)


def test_a_manifest_reading_past_its_tokens_file_writes_nothing(tmp_path):
    phase_dir = tmp_path / "phases" / "p"
    (phase_dir / "tokens").mkdir(parents=True)
    pq.write_table(tokens_table(["k0"], ["one"]), phase_dir / "tokens" / "s-00000.parquet")
    rows = np.array([[0, 0, 0], [0, 1, 1]], np.int32)
    with pytest.raises(ValueError, match=r"s-00000.parquet: fewer rows than the manifest reads"):
        write_captions(phase_dir, (["s-00000"], rows))
    assert sorted(p.name for p in phase_dir.iterdir()) == ["tokens"]  # no captions, no temp


def test_a_run_config_with_train_time_captions_gets_its_captions(tagged):
    from sdtrain.config import TrainConfig

    base = dict(
        phase="p", phase_dir=str(tagged), run_dir="r", model="tiny", lr=1e-4, warmup_steps=0,
        epochs=1, batch_size=2, cfg_dropout=0.1, min_snr_gamma=5.0, seed=4,
    )  # fmt: skip
    assert cap.for_run(TrainConfig(**base)) is None  # stored ids, as before
    config = TrainConfig(**base, train_time_captions=True, shuffle_tags_p=1.0, keep_tokens=1)
    captions = cap.for_run(config)
    assert captions.settings == CaptionSettings(shuffle_tags_p=1.0, keep_tokens=1)
    assert captions.caption(0, 2) == TrainTimeCaptions(tagged, captions.settings, 4).caption(0, 2)
