"""`make demo`: the whole chain on the demo source, through real deployments and a worker.

Starts (if absent) the data root's own Prefect server and a worker, deploys prefect.yaml,
runs `prefect deployment run build-latents/demo` then `curriculum/demo` (training, then the
eval), waits for both and prints what happened to every sample, read from the stats records on
disk, and the eval's table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import flows.cli.local as local
import flows.cli.progress as progress
from flows.build_latents import source_summary
from flows.curriculum import bucket_line
from flows.execution.stages import DISPLAY
from tasks.evaluation import eval_report
from tasks.runtime.shards import data_root

DEFAULT_PORT = local.DEFAULT_PORT


class DemoFailed(Exception):
    """A demo flow run did not complete."""


def run_deployment(name: str, root: Path, port: int) -> None:
    print(f"$ prefect deployment run {name} --watch", flush=True)
    done = local.prefect_cli(
        ["deployment", "run", name, "--watch", "--watch-interval", "2"], root, port
    )
    if done.returncode != 0 or "Completed" not in done.stdout:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise DemoFailed(
            f"{name} did not complete; logs: {local.prefect_dir(root)}/worker.log\n{tail}"
        )


def format_summary(root: Path, port: int, seconds: float) -> str:
    stages = source_summary(root, "demo")
    num_input = stages["metadata"]["num_in"]
    lines = [
        "",
        f"sdpipe demo finished in {seconds:.0f} s",
        "",
        f"{'stage':<15}{'in':>6}{'out':>6}  dropped by reason",
    ]
    num_dropped = 0
    for stage, s in stages.items():
        num_dropped += sum(s["dropped"].values())
        reasons = ", ".join(f"{r}={n}" for r, n in s["dropped"].items()) or "-"
        lines.append(f"{DISPLAY[stage]:<15}{s['num_in']:>6}{s['num_out']:>6}  {reasons}")
    num_kept = stages["latents"]["num_out"]
    balance = "ok" if num_kept + num_dropped == num_input else "MISMATCH"
    lines += [
        "",
        f"input rows {num_input} = kept {num_kept} + dropped {num_dropped}: {balance}",
        f"latents written: {num_kept} samples in {stages['latents']['num_shards']} shards "
        f"under {root / 'demo' / 'latents'}",
    ]
    summary = json.loads((root / "runs" / "demo" / "summary.json").read_text())
    lines += [
        f"training: {summary['steps']} steps on {summary['world_size']} ranks, loss "
        f"{summary['first_loss']:.4f} (first step) -> {summary['last_loss']:.4f} (last step)",
        f"checkpoint: {summary['checkpoint']}",
        f"sample grid: {summary['sample_grid']}",
    ]
    if line := bucket_line(summary):  # a bucketed set: training rows per aspect bucket
        lines.insert(-2, line)
    if scores := eval_report.read_summary(root, "demo"):
        lines += [
            "",
            eval_report.format_table(scores, None),
            f"eval: {scores['num_images']} images, {scores['num_steps']} DDIM steps, random-weight "
            "scorer and Inception: the numbers are noise, the machinery is real; "
            f"{root / 'runs' / 'demo' / 'eval'}",
        ]
    lines += [
        "",
        f"dashboard: http://127.0.0.1:{port}  (flow runs, task runs per shard, artifacts)",
        "the server and worker keep running; stop them with: make stop",
    ]
    return "\n".join(lines)


def main() -> None:
    start = time.monotonic()
    root = data_root()
    root.mkdir(parents=True, exist_ok=True)
    print(f"data root: {root}", flush=True)
    # The root's own server (never whatever answers on 4200), as every sdpipe command finds it.
    port, which = local.ensure_local_api(root)
    print(f"{which}; SQLite under {local.prefect_dir(root)}", flush=True)
    local.deploy(root, port)
    if local.ensure_worker(root, port):
        print(
            f"started a process worker for pool '{local.WORK_POOL}' (the demo's deployments "
            "run offline: HF_HUB_OFFLINE=1 in their job variables, not in the worker)",
            flush=True,
        )
    with progress.watch(root, sources=["demo"]):
        run_deployment("build-latents/demo", root, port)
    with progress.watch(root, phases=["demo"]):
        run_deployment("curriculum/demo", root, port)
    print(format_summary(root, port, time.monotonic() - start))
