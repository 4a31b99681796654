"""Batch generation on one device: prompts x seeds, as `sdpipe sample` makes each image, resumable
by file, new files for new settings, bad input in one line."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from flows import cli
from sdtrain.sampling import generate
from sdtrain.weights import load_networks
from tasks.generation import generate as gen
from tasks.generation.generate import GenerateError, Prompt, Settings, generate_images
from tests.tasks.tiny_weights import RUN_NEGATIVE, write_tiny_weights

CPU = torch.device("cpu")
FEW_STEPS = Settings(num_steps=4)

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_tiny_weights(tmp_path_factory.mktemp("run"))


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def test_prompt_file_rules(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("  a red cat  \n\n# a comment\n   # indented comment\na castle, at dusk\n")
    assert gen.read_prompts(path) == ["a red cat", "a castle, at dusk"]
    path.write_text("\n# only comments\n\n")
    with pytest.raises(GenerateError, match="no prompts"):
        gen.read_prompts(path)
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(GenerateError, match="not UTF-8"):
        gen.read_prompts(path)
    with pytest.raises(GenerateError, match="no such prompt file"):
        gen.read_prompts(tmp_path / "missing.txt")


def test_images_are_prompts_x_seeds_made_as_sample_makes_them(run_dir, tmp_path):
    prompts = ["a red cat", "a castle on a hill"]
    index = generate_images(
        run_dir, prompts, [0, 1, 2], tmp_path, devices=["cpu"], settings=FEW_STEPS, batch_size=4
    )
    assert index.equals(pq.read_table(tmp_path / gen.INDEX))
    rows = index.to_pylist()
    assert [(r["prompt"], r["seed"]) for r in rows] == [(p, s) for p in prompts for s in (0, 1, 2)]
    assert {r["negative_prompt"] for r in rows} == {RUN_NEGATIVE}  # the run's, as its grids
    assert all(r["ema"] and r["num_steps"] == 4 and r["guidance_scale"] == 7.5 for r in rows)
    assert {r["device"] for r in rows} == {"cpu"}
    assert all(Image.open(tmp_path / r["file"]).size == (64, 64) for r in rows)

    # Each image is `sdpipe sample`'s for its prompt and seed, though made in a batch of four:
    # EMA weights, the run's negative prompt, the image's own seed.
    castle_1 = pixels(tmp_path / rows[4]["file"])
    ema = load_networks(run_dir, device=CPU)
    (alone,) = generate(ema, [prompts[1]], negative_prompt=RUN_NEGATIVE, num_steps=4, seed=1)
    assert np.abs(castle_1 - np.asarray(alone).astype(np.int16)).max() <= 2
    live = load_networks(run_dir, use_ema=False, device=CPU)
    (from_live,) = generate(live, [prompts[1]], negative_prompt=RUN_NEGATIVE, num_steps=4, seed=1)
    assert np.abs(castle_1 - np.asarray(from_live).astype(np.int16)).max() > 10
    assert np.abs(castle_1 - pixels(tmp_path / rows[3]["file"])).max() > 10  # seed 0 differs

    text = Image.open(tmp_path / rows[4]["file"]).text["parameters"]
    assert text.startswith("a castle on a hill\nNegative prompt: lowres, watermark\nSteps: 4,")
    assert "CFG scale: 7.5, Seed: 1, Size: 64x64" in text


def test_a_rerun_makes_only_what_the_folder_lacks(run_dir, tmp_path):
    def run(prompts, seeds, settings=FEW_STEPS):
        calls = []
        index = generate_images(
            run_dir,
            prompts,
            seeds,
            tmp_path,
            devices=["cpu"],
            settings=settings,
            on_progress=lambda done, total: calls.append((done, total)),
        )
        return index, calls

    first, _ = run(["a red cat", "a castle"], [0, 1])
    before = {f: os.stat(tmp_path / f) for f in first["file"].to_pylist()}

    # More seeds per prompt: the old images stay as they are, only the new seed is made.
    (tmp_path / ".00000-2-x.png.tmp-12345").write_bytes(b"half an image of a killed run")
    index, calls = run(["a red cat", "a castle"], [0, 1, 2])
    assert calls[0] == (4, 6) and calls[-1] == (6, 6)
    assert index.num_rows == 6 and set(before) < set(index["file"].to_pylist())
    for f, st in before.items():
        now = os.stat(tmp_path / f)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]

    # A deleted image is made again, and only it.
    gone = index["file"][1].as_py()
    (tmp_path / gone).unlink()
    _, calls = run(["a red cat", "a castle"], [0, 1, 2])
    assert calls[0] == (5, 6) and (tmp_path / gone).exists()

    # Other settings are other images (new files), and a prompt may carry its own settings.
    own = Settings(num_steps=3, guidance_scale=8.5, negative_prompt="")
    index, calls = run(
        ["a red cat", Prompt("a castle", own)], [0], Settings(num_steps=4, guidance_scale=5.0)
    )
    assert calls[0] == (0, 2)
    rows = index.to_pylist()
    assert [(r["num_steps"], r["guidance_scale"], r["negative_prompt"]) for r in rows] == [
        (4, 5.0, RUN_NEGATIVE),
        (3, 8.5, ""),
    ]
    assert not {r["file"] for r in rows} & set(first["file"].to_pylist())


def test_chunks_share_settings_and_workers_share_the_work():
    items = [
        gen.Item(
            prompt_index=i, prompt=f"p{i}", seed=s, num_steps=10 if i < 2 else 40,
            guidance_scale=7.5, negative_prompt="", file=f"{i}-{s}.png",
        )
        for i in range(4) for s in range(3)
    ]  # fmt: skip
    chunks = gen.make_chunks(items, 4)
    assert [[it.file for it in c] for c in chunks] == [
        ["0-0.png", "0-1.png", "0-2.png", "1-0.png"],
        ["1-1.png", "1-2.png"],
        ["2-0.png", "2-1.png", "2-2.png", "3-0.png"],
        ["3-1.png", "3-2.png"],
    ]
    # Each chunk, in order, to the worker with the least images x steps so far: 40 | 20,
    # then the 160 to the second, the 80 to the first.
    shares = gen.assign(chunks, 2)
    assert shares == [[chunks[0], chunks[3]], [chunks[1], chunks[2]]]


def test_bad_input_fails_in_one_line(run_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# nothing yet\n")
    out = str(tmp_path / "out")
    assert cli.main(["generate", str(prompts), "--weights", str(run_dir), "--out", out]) == 2
    prompts.write_text("a red cat\n")
    assert cli.main(["generate", str(prompts), "--weights", "no-such-run", "--out", out]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(e.startswith("sdpipe: error: ") for e in errors)
    assert "no prompts" in errors[0] and "neither a weights folder nor a run" in errors[1]

    with pytest.raises(GenerateError, match="seeds must be distinct"):
        generate_images(run_dir, ["a cat"], [3, 3], tmp_path / "a")
    with gen.batch_lock(tmp_path / "busy"), pytest.raises(GenerateError, match="another batch"):
        generate_images(run_dir, ["a cat"], [0], tmp_path / "busy")
