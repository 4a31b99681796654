"""Launch one phase's training under torchrun and return its summary.

The trainer runs in child processes, never in the caller: DDP needs one process per rank, and a
crashed rank must not take the orchestrator down with it. stdout and stderr are merged so the
caller sees rank output and Python tracebacks in the order they happened.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from catalog import Phase
from sdtrain.config import TrainConfig, run_config_for_phase
from tasks.runtime.net import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# After a SIGTERM, torchrun gives its ranks `stop_grace_s` to checkpoint, then kills them; we wait
# that long and this much more for torchrun itself.
STOP_MARGIN_S = 30
# A line of one node of a multi-node training (tasks/phases/train_nodes.py): `[node 1 10.0.0.5] `.
NODE_PREFIX = re.compile(r"^\[node \d+ [^\]]*\] ")


class TrainingFailed(Exception):
    """torchrun exited non-zero; the message ends with the last lines it printed."""


def node_line(node: int, address: str, line: str) -> str:
    return f"[node {node} {address}] {line}"


def without_node(line: str) -> str:
    """A trainer line as its rank printed it, without the node prefix of a multi-node run."""
    return NODE_PREFIX.sub("", line, count=1)


def on_nodes(nodes: int, cluster: str) -> bool:
    """Whether a training goes through the Ray cluster (`launch_training_on_nodes`): more than
    one node, or a cluster named."""
    return nodes > 1 or bool(cluster)


def train_config_for_phase(
    phase: Phase,
    *,
    phase_dir: str | Path,
    run_dir: str | Path,
    init_from: str | Path = "",
    resume_remixed: bool = False,
) -> TrainConfig:
    """The run config of a catalog phase: the base config with the phase's settings;
    `resume_remixed`: its checkpoint resumes on the set a removal re-linked (mix's `remixed`)."""
    return run_config_for_phase(
        phase,
        phase_dir=phase_dir,
        run_dir=run_dir,
        init_from=init_from,
        resume_remixed=resume_remixed,
    )


def launch_training(
    config: TrainConfig,
    *,
    nproc: int | None = None,
    on_line: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
) -> dict:
    """Run `sdtrain.train` on `nproc` ranks (default: every GPU, or 2 CPU ranks) and wait;
    `env`: more environment for the ranks (e.g. the CUDA_VISIBLE_DEVICES of claimed GPUs)."""
    import torch

    num_procs = nproc or torch.cuda.device_count() or 2
    run_dir = Path(config.run_dir)
    config_path = run_dir / "config.json"
    config.to_json(config_path)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(num_procs),
        "--master_port", str(free_port()),
        "--shutdown-timeout", str(config.stop_grace_s),
        "-m", "sdtrain.train", "--config", str(config_path),
    ]  # fmt: skip
    # One thread per rank: torch would otherwise start a full pool in every rank.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    last_lines: collections.deque[str] = collections.deque(maxlen=20)
    with subprocess.Popen(
        command, cwd=PROJECT_ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
    ) as proc:  # fmt: skip
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                last_lines.append(line)
                on_line(line)
        except BaseException:
            # Cancelled or interrupted: torchrun passes SIGTERM to the ranks, which checkpoint
            # at the next step and exit; a rerun resumes from there.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=config.stop_grace_s + STOP_MARGIN_S)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if proc.returncode != 0:
        tail = "\n".join(last_lines)
        raise TrainingFailed(f"torchrun exited with {proc.returncode}: {tail}")
    return json.loads((run_dir / "summary.json").read_text())
