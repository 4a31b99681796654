"""The training on the dashboard: loss and lr curves and the latest sample grid, as pictures.

Drawn from the run folder rank 0 writes (`log.jsonl`, `samples/*.png`), not from the console
lines: a resumed run's curve starts at step 1 and shows what the weights on disk went through.
One markdown artifact per phase is updated in place at each refresh, because a new version per
refresh would pile up megabytes of images in the server's database over a long run.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from sdtrain.monitor import read_log
from tasks.phases.train import without_node
from tasks.runtime import pictures

GRID_LINE = re.compile(r"^sample grid step (\d+): ")
VALIDATION_LINE = re.compile(r"^step \d+ val_loss=")
STEP_LINE = re.compile(r"^step \d+/\d+ ")
REFRESH_EVERY_S = 60.0  # a redraw on step lines alone (grids and validations redraw at once)
GRID_WIDTH = 1024  # px: a 4-prompt grid of 512 px samples is shrunk to this
GRID_MIN_WIDTH = 512  # px: a tiny model's grid (4 x 64 px) is enlarged, pixels kept sharp
GRID_BUDGET = 700_000  # characters of the grid's data URI: the artifact stays under 1 MB


def latest_grid(run_dir: Path) -> Path | None:
    """The sample grid written last (`samples/step-NNNNNN.png` or `samples/final.png`)."""
    grids = list((run_dir / "samples").glob("*.png"))
    return max(grids, key=lambda p: p.stat().st_mtime_ns) if grids else None


def curves(run_dir: Path) -> Image.Image:
    """Training loss with the validation loss (EMA) as dots, and the learning rate (log y)."""
    records = read_log(run_dir / "log.jsonl")
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    lr = [(r["step"], r["lr"]) for r in records if "lr" in r]
    return pictures.line_chart(
        [
            pictures.Panel(
                title="loss",
                series=[
                    pictures.Series(name="train", points=train),
                    pictures.Series(name="validation (EMA)", points=val, dots=True),
                ],
            ),
            pictures.Panel(
                title="learning rate",
                series=[pictures.Series(name="lr", points=lr)],
                log_y=True,
            ),
        ]
    )


def markdown(run_dir: Path, heading: str) -> str:
    """`heading`, the curves and the latest grid with its prompts; under 1 MB whatever the
    model's size."""
    records = read_log(run_dir / "log.jsonl")
    steps = [r for r in records if "loss" in r]
    lines = [heading]
    if steps:
        last = steps[-1]
        total = last.get("total_steps")
        lines.append(
            f"step {last['step']}{f'/{total}' if total else ''}, loss {last['loss']:.4f}, "
            f"lr {last['lr']:.2e}, {last['samples_per_s']:.1f} samples/s"
        )
    lines += ["", f"![loss and learning rate]({pictures.png_uri(curves(run_dir))})"]
    grid = latest_grid(run_dir)
    if grid is not None:
        step = "final" if grid.stem == "final" else f"step {int(grid.stem.split('-')[-1])}"
        with Image.open(grid) as image:
            if image.width < GRID_MIN_WIDTH:
                factor = -(-GRID_MIN_WIDTH // image.width)
                image = image.resize(
                    (image.width * factor, image.height * factor), Image.Resampling.NEAREST
                )
            uri = pictures.fitted_jpeg_uri(image, max_width=GRID_WIDTH, max_chars=GRID_BUDGET)
        lines += ["", f"## Sample grid, {step} (EMA weights)", ""]
        lines += [f"{i}. {pictures.md_text(p)}" for i, p in enumerate(_prompts(run_dir), 1)]
        lines += ["", f"![sample grid {step}]({uri})", "", pictures.md_code(grid, limit=400)]
    return "\n".join(lines) + "\n"


def _prompts(run_dir: Path) -> list[str]:
    config = run_dir / "config.json"
    return list(json.loads(config.read_text()).get("sample_prompts", [])) if config.exists() else []


class LivePictures:
    """The phase's pictures artifact: created at the first refresh, then updated in place."""

    def __init__(self, run_dir: Path, *, key: str, title: str):
        self.run_dir, self.key, self.title = run_dir, key, title
        self.artifact_id = None
        self.last_refresh = -float("inf")

    def refresh(self) -> None:
        self.last_refresh = time.monotonic()
        try:
            self.publish(markdown(self.run_dir, f"# {pictures.md_text(self.title)}: training"))
        except Exception as e:  # the pictures are a view: never stop a training for them
            print(f"dashboard pictures not refreshed: {type(e).__name__}: {e}", flush=True)

    def publish(self, text: str) -> None:
        from prefect.artifacts import create_markdown_artifact
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactUpdate

        if self.artifact_id is None:
            self.artifact_id = create_markdown_artifact(
                text, key=self.key, description=f"{self.title}: loss, lr, latest sample grid"
            )
            return
        with get_client(sync_client=True) as client:
            client.update_artifact(self.artifact_id, ArtifactUpdate(data=text))

    def watching(self, on_line: Callable[[str], None]) -> Callable[[str], None]:
        """`on_line`, then a refresh when a trainer line says a grid or a validation loss was
        written, and at most every REFRESH_EVERY_S on step lines."""

        def handle(line: str) -> None:
            on_line(line)
            due = time.monotonic() - self.last_refresh >= REFRESH_EVERY_S
            said = without_node(line)  # as the rank printed it, on any node
            if (
                GRID_LINE.match(said)
                or VALIDATION_LINE.match(said)
                or (due and STEP_LINE.match(said))
            ):
                self.refresh()

        return handle
