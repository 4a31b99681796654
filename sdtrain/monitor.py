"""What rank 0 reports (console lines, `log.jsonl`, TensorBoard, W&B when configured), and
the window of steps every rank sums between two records. A resumed run first drops what the
killed run logged after its checkpoint (log.jsonl, TensorBoard via `purge_step`): the logs are
the history of the weights on disk. The curriculum flow redraws the dashboard from these files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sdtrain.atomic import atomic_path
from sdtrain.config import TrainConfig


class LogWindow:
    """The optimizer steps since the last log record: this rank's summed loss of the finite
    ones, the data wait, rank 0's rows (the data order), the last step's lr and gradient norm."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.rows: list[torch.Tensor] = []
        self.lr, self.grad_norm = 0.0, torch.zeros(())
        self.reset(time.perf_counter())

    def reset(self, now: float) -> None:
        self.loss.zero_()
        self.rows.clear()
        self.steps, self.finite, self.wait, self.start = 0, 0, 0.0, now


class Monitor:
    def __init__(self, config: TrainConfig, *, start_step: int, enabled: bool):
        self.enabled = enabled
        self.writer = self.wandb = None
        if not enabled:
            return
        if config.wandb_project:
            self.wandb = _start_wandb(config)
        run_dir = Path(config.run_dir)
        self.log_path = run_dir / "log.jsonl"
        _truncate_log(self.log_path, after_step=start_step)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
        )

    def step(
        self, step: int, total_steps: int, metrics: dict[str, float], *, rows_crc: int
    ) -> None:
        """`rows_crc`: a checksum of the rows rank 0 trained on since the last record."""
        if not self.enabled:
            return
        print(
            f"step {step}/{total_steps} loss={metrics['loss']:.4f} lr={metrics['lr']:.2e} "
            f"grad_norm={metrics['grad_norm']:.3f} samples/s={metrics['samples_per_s']:.1f} "
            f"data_wait={metrics['data_wait']:.3f}",
            flush=True,
        )
        self._record(step, metrics, rows_crc=rows_crc, total_steps=total_steps)

    def validation(self, step: int, val_loss: float, *, is_best: bool) -> None:
        if not self.enabled:
            return
        print(f"step {step} val_loss={val_loss:.4f}{' (best)' if is_best else ''}", flush=True)
        self._record(step, {"val_loss": val_loss})

    def grid(self, step: int, image: Image.Image, path: Path) -> None:
        if not self.enabled:
            return
        with atomic_path(path) as tmp:
            image.save(tmp, format="PNG")
        print(f"sample grid step {step}: {path}", flush=True)
        self.writer.add_image("samples", np.asarray(image), step, dataformats="HWC")
        if self.wandb is not None:
            import wandb

            self.wandb.log({"samples": wandb.Image(image)}, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()

    def _record(self, step: int, metrics: dict[str, float], **extra) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        with open(self.log_path, "a") as log:
            log.write(json.dumps({"step": step, **metrics, **extra}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)


def read_log(path: Path) -> list[dict]:
    """The records of a log.jsonl; a line cut short by a kill is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _truncate_log(path: Path, *, after_step: int) -> None:
    if not path.exists():
        return
    kept = [r for r in read_log(path) if r["step"] <= after_step]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _start_wandb(config: TrainConfig):
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            f"wandb_project={config.wandb_project!r} is set but wandb is not installed: "
            "pip install wandb (or leave wandb_project empty)"
        ) from None
    run_dir = str(Path(config.run_dir).resolve())
    return wandb.init(
        project=config.wandb_project,
        name=config.phase,
        id=hashlib.sha1(run_dir.encode()).hexdigest()[:16],  # a resumed run continues it
        resume="allow",
        dir=run_dir,
        config=dataclasses.asdict(config),
    )
