"""Launch one phase's training under torchrun and return its summary.

The trainer runs in child processes, never in the caller: DDP needs one process per rank, and a
crashed rank must not take the orchestrator down with it. stdout and stderr are merged so the
caller sees rank output and Python tracebacks in the order they happened.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from catalog import Phase
from sdtrain.config import TrainConfig
from tasks.net import free_port

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class TrainingFailed(Exception):
    """torchrun exited non-zero; the message ends with the last lines it printed."""


def train_config_for_phase(
    phase: Phase, *, phase_dir: str | Path, run_dir: str | Path, init_from: str | Path = ""
) -> TrainConfig:
    """The run config of a catalog phase; `init_from` is the previous run's final/ folder."""
    return TrainConfig(
        phase=phase.name,
        phase_dir=str(phase_dir),
        run_dir=str(run_dir),
        model=phase.model,
        lr=phase.lr,
        warmup_steps=phase.warmup_steps,
        epochs=phase.epochs,
        max_steps=phase.max_steps,
        batch_size=phase.batch_size,
        grad_accum=phase.grad_accum,
        cfg_dropout=phase.cfg_dropout,
        min_snr_gamma=phase.min_snr_gamma,
        seed=phase.seed,
        init_from=str(init_from),
        **({"sample_prompts": phase.sample_prompts} if phase.sample_prompts else {}),
    )


def launch_training(
    config: TrainConfig, *, nproc: int | None = None, on_line: Callable[[str], None] = print
) -> dict:
    """Run `sdtrain.train` on `nproc` ranks (default: every GPU, or 2 CPU ranks) and wait."""
    import torch

    num_procs = nproc or torch.cuda.device_count() or 2
    run_dir = Path(config.run_dir)
    config_path = run_dir / "config.json"
    config.to_json(config_path)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(num_procs),
        "--master_port", str(free_port()),
        "-m", "sdtrain.train", "--config", str(config_path),
    ]  # fmt: skip
    # One thread per rank: torch would otherwise start a full pool in every rank.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    last_lines: collections.deque[str] = collections.deque(maxlen=20)
    with subprocess.Popen(
        command, cwd=PROJECT_ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
    ) as proc:  # fmt: skip
        for line in proc.stdout:
            line = line.rstrip("\n")
            last_lines.append(line)
            on_line(line)
    if proc.returncode != 0:
        tail = "\n".join(last_lines)
        raise TrainingFailed(f"torchrun exited with {proc.returncode}: {tail}")
    return json.loads((run_dir / "summary.json").read_text())
