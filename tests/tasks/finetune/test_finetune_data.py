"""A fine-tune's data: the encode stage's image rules on the instance folder (each drop counted
under its reason, named in one line), class images made once and reused, and the bad inputs
of a catalog entry failing in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from catalog import CatalogError, load_catalog
from flows import cli
from flows.finetune import preflight
from tasks.finetune import data as ft
from tests.tasks import bad_images as bad
from tests.tasks.tiny_weights import write_tiny_weights

CPU = [torch.device("cpu")]

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_tiny_weights(root / "runs" / "demo")  # the demo fine-tunes' base
    return root


def spec(name: str, **changes):
    return dataclasses.replace(load_catalog().finetune(name), **changes)


def test_instance_images_pass_the_encode_rules_each_drop_counted_and_named(root):
    folder = root / "finetunes" / "demo-inpaint" / "images"
    folder.mkdir(parents=True)
    files = {
        "plain.jpg": bad.jpeg(96, 80),
        "cmyk.jpg": bad.cmyk_jpeg(),  # converted, kept
        "alpha.png": bad.rgba_png(alpha=128),  # composited over white, kept
        "corrupt.jpg": bad.not_an_image(),
        "cut.jpg": bad.truncated_jpeg(),
        "tiny.png": bad.encode(bad.canvas(20, 20), "PNG"),  # under half the 64 px side
        "notes.txt": b"a caption of plain.jpg? no: captions are named like their image",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "plain.txt").write_text("a red square\n")
    base = ft.resolve_base("demo", root)
    lines = []
    stats = ft.prepare(root, spec("demo-inpaint"), base, devices=CPU, on_line=lines.append)
    assert stats["num_instance"] == 3 and stats["num_class"] == 0
    assert stats["dropped"] == {"decode_error": 1, "truncated": 1, "too_small": 1}
    assert stats["converted"] == {"cmyk": 1, "alpha": 1}
    assert {"corrupt.jpg: dropped, decode_error", "cut.jpg: dropped, truncated"} <= set(lines)
    assert "tiny.png: dropped, too_small" in lines
    data = root / "finetunes" / "demo-inpaint" / "data"
    manifest = pq.read_table(data / "manifest.parquet").to_pylist()
    assert [r["key"] for r in manifest] == ["alpha.png", "cmyk.jpg", "plain.jpg"]
    assert manifest[2]["caption"] == "a red square" and manifest[0]["caption"] == ""
    latents, pixels = np.load(data / "latents.npy"), np.load(data / "pixels.npy")
    assert latents.shape == (3, 4, 8, 8) and latents.dtype == np.float16
    assert pixels.shape == (3, 64, 64, 3)
    # CMYK (0, 255, 255, 0) is red, alpha 128 over white is a light red: decoded by the rules.
    assert np.abs(pixels[1, 32, 32].astype(int) - (255, 0, 0)).max() <= 8
    assert pixels[0, 32, 32, 1] > 100 and pixels[0, 32, 32, 0] > 200
    # The encode stage's VAE path: the same latents as tasks.latents.encode makes of those pixels.
    from tasks.latents.encode import encode_images, vae_for

    model = load_catalog().model("tiny")
    expected = encode_images(vae_for(model, CPU[0]), pixels, model.scaling_factor)
    assert np.array_equal(latents, expected)


def test_a_folder_without_usable_images_fails_in_one_line(root, tmp_path):
    base = ft.resolve_base("demo", root)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no images here")
    with pytest.raises(ft.FinetuneError, match=r"images folder .*empty: no images \(files"):
        ft.prepare(root, spec("demo-inpaint", images=str(empty)), base, devices=CPU)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.jpg").write_bytes(bad.not_an_image())
    (broken / "b.png").write_bytes(bad.encode(bad.canvas(8, 8), "PNG"))
    with pytest.raises(
        ft.FinetuneError, match=r"broken: no usable images \(decode_error=1, too_small=1\)"
    ):
        ft.prepare(root, spec("demo-inpaint", images=str(broken)), base, devices=CPU)


def test_class_images_are_made_once_and_the_data_is_rebuilt_when_the_images_change(root):
    folder = root / "finetunes" / "demo-dreambooth" / "instance"
    folder.mkdir(parents=True)
    for i in range(2):
        (folder / f"{i}.jpg").write_bytes(bad.jpeg(64, 64, bad.GREEN))
    base = ft.resolve_base("demo", root)
    entry = spec("demo-dreambooth", num_class_images=2, class_steps=2)
    stats = ft.prepare(root, entry, base, devices=CPU)
    assert (stats["num_instance"], stats["num_class"]) == (2, 2)
    class_dir = root / "finetunes" / "demo-dreambooth" / "class-images"
    made = {p.name: p.stat().st_mtime_ns for p in class_dir.glob("*.png")}
    assert len(made) == 2
    manifest = pq.read_table(root / "finetunes" / "demo-dreambooth" / "data" / "manifest.parquet")
    assert manifest["kind"].to_pylist() == ["instance"] * 2 + ["class"] * 2
    assert set(manifest["caption"].to_pylist()) == {"a photo of sks dog", "a photo of dog"}

    lines = []
    ft.prepare(root, entry, base, devices=CPU, on_line=lines.append)  # nothing changed
    assert any(line.startswith("data: reused") for line in lines)
    (folder / "2.jpg").write_bytes(bad.jpeg(64, 64, bad.BLUE))
    more = ft.prepare(root, dataclasses.replace(entry, num_class_images=3), base, devices=CPU)
    assert (more["num_instance"], more["num_class"]) == (3, 3)
    again = {p.name: p.stat().st_mtime_ns for p in class_dir.glob("*.png")}
    assert len(again) == 3 and all(again[name] == t for name, t in made.items())  # reused


def test_a_token_the_tokenizer_splits_is_named_in_a_warning():
    assert ft.token_warning("sks") is None
    warning = ft.token_warning("qwzxtkn")
    assert warning.startswith("unique token 'qwzxtkn' is ") and "CLIP tokens" in warning


def test_bad_entries_fail_in_one_line_naming_the_item(root, tmp_path, capsys):
    with pytest.raises(ft.FinetuneError, match=r"base 'phase-7': no final weights at .*phase-7"):
        ft.resolve_base("phase-7", root)
    with pytest.raises(ft.FinetuneError, match=r"base '/nowhere/sd15': /nowhere/sd15 does not"):
        ft.resolve_base("/nowhere/sd15", root)
    entry = load_catalog().finetune("demo-dreambooth")
    with pytest.raises(CatalogError, match=r"num_class_images: 0 class images with prior"):
        ft.with_overrides(entry, {"num_class_images": 0})
    assert ft.with_overrides(entry, {"num_class_images": 0, "prior_preservation": False})
    with pytest.raises(CatalogError, match=r"demo-dreambooth.lr: expected a number, got 'fast'"):
        ft.with_overrides(entry, {"lr": "fast"})

    # The command: one line on stderr, exit code 2, before anything runs.
    argv = ["--data-root", str(tmp_path), "finetune", "demo-dreambooth"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert cli.main([*argv, "--sweep", "lr"]) == 2
    assert "expected KEY=VALUE[,VALUE...]" in capsys.readouterr().err
    assert cli.main([*argv, "--sweep", "num_class_images=4,0"]) == 2  # nothing submitted
    assert "num_class_images: 0 class images" in capsys.readouterr().err


def test_preflight_warns_about_a_split_token(root):
    folder = root / "finetunes" / "demo-lora" / "instance"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "0.jpg").write_bytes(bad.jpeg())
    _, _, warnings = preflight("demo-lora", {"token": "qwzxtkn"}, root)
    assert len(warnings) == 1 and "'qwzxtkn'" in warnings[0]
