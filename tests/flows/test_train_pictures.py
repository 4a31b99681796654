"""The training's pictures: curves and the newest sample grid drawn from the run folder, under the
artifact budget, refreshed when the trainer says a grid or a validation loss was written."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
from PIL import Image

from flows import train_pictures
from tests.image_sources import markdown_sources


def _run_dir(tmp_path, *, steps: int = 40):
    run = tmp_path / "runs" / "demo"
    (run / "samples").mkdir(parents=True)
    with open(run / "log.jsonl", "w") as log:
        for step in range(4, steps + 1, 4):
            record = {"step": step, "loss": 1 / step, "lr": 1e-4, "samples_per_s": 12.5}
            log.write(json.dumps({**record, "total_steps": steps}) + "\n")
            if step % 20 == 0:
                log.write(json.dumps({"step": step, "val_loss": 1.1 / step}) + "\n")
        log.write('{"step": 44, "loss"')  # a line cut short by a kill
    prompts = ["a red circle", "![x](http://t.example/a.png)"]
    (run / "config.json").write_text(json.dumps({"sample_prompts": prompts}))
    return run


def _grid(path, color, *, side=512, when_ns=None):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (side, 4 * side, 3), dtype=np.uint8)  # noise: JPEG's worst
    pixels[:, :8] = color
    Image.fromarray(pixels).save(path)
    if when_ns is not None:
        os.utime(path, ns=(when_ns, when_ns))


def _decode(uri: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))


def test_curves_and_the_newest_grid_fit_in_one_artifact(tmp_path):
    run = _run_dir(tmp_path)
    _grid(run / "samples" / "step-000020.png", (255, 0, 0), when_ns=1_000_000_000)
    _grid(run / "samples" / "final.png", (0, 0, 255), when_ns=2_000_000_000)
    text = train_pictures.markdown(run, "# demo: training")
    assert len(text.encode()) < 1_000_000
    assert "step 40/40, loss 0.0250, lr 1.00e-04, 12.5 samples/s" in text
    assert "## Sample grid, final (EMA weights)" in text
    curve_uri, grid_uri = markdown_sources(text)  # prompts are text: nothing else loads
    curve, grid = _decode(curve_uri), _decode(grid_uri)
    assert curve.format == "PNG" and curve.size == (720, 440)
    assert grid.format == "JPEG" and grid.width == train_pictures.GRID_WIDTH
    left_edge = np.asarray(grid)[:, :4].reshape(-1, 3).mean(axis=0)
    assert left_edge[2] > 150 and left_edge[0] < 100  # the final grid (blue), not step 20 (red)


def test_a_tiny_models_grid_is_enlarged_to_be_seen(tmp_path):
    run = _run_dir(tmp_path)
    _grid(run / "samples" / "final.png", (0, 0, 255), side=64)  # 256 x 64
    (_, grid_uri) = markdown_sources(train_pictures.markdown(run, "# demo"))
    assert _decode(grid_uri).size == (512, 128)


def test_grid_and_validation_lines_refresh_step_lines_at_most_every_minute(tmp_path, capsys):
    run = _run_dir(tmp_path)
    lines: list[str] = []
    published: list[tuple[int, str]] = []

    class Recorded(train_pictures.LivePictures):
        def publish(self, text: str) -> None:  # the server's side is the browser test's
            published.append((len(lines), text))
            if len(published) == 2:
                raise ConnectionError("server restarting")

    live = Recorded(run, key="demo-train-pictures", title="demo")
    handle = live.watching(lines.append)
    handle("step 4/40 loss=0.2500 lr=1.00e-04 grad_norm=1.000 samples/s=12.5 data_wait=0.000")
    handle("step 8/40 loss=0.1250 lr=1.00e-04 grad_norm=1.000 samples/s=12.5 data_wait=0.000")
    handle("step 20 val_loss=0.0550 (best)")
    handle(f"sample grid step 20: {run / 'samples' / 'step-000020.png'}")
    handle("rank 1: some other line")
    assert len(lines) == 5  # every line reaches the caller's handler, a failed refresh too
    assert [n for n, _ in published] == [1, 3, 4]  # the first step line, validation, grid
    assert published[0][1].startswith("# demo: training\nstep 40/40")
    assert "pictures not refreshed: ConnectionError: server restarting" in capsys.readouterr().out
