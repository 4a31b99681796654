"""The whole build-latents flow on generated samples: wall time per stage and for the flow.

Runs `build-latents` on the demo generator at `--images` (planted faults included), served on
loopback, in a fresh data root, on a temporary Prefect server unless PREFECT_API_URL is set.
A stage's wall time runs from its first shard's start to its last shard's end, read from the
stats records (a record is written when its shard ends, `seconds` after it began); stages
overlap, so they add up to more than the flow. The last line is one JSON object: `seconds`
(the flow), `stages` (name -> seconds), `samples` (input rows), and what else it knows.

Usage: python bench/build_latents.py [--images 2000] [--shard-size 250] [--workers N]
Against another checkout (a before/after): copy this file into its bench/ and run it there
(it measures the checkout it lies in).
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import inspect
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


def stage_walls(root: Path, source: str, stages) -> dict[str, tuple[float, float, int]]:
    """Per stage: (first shard's start, last shard's end, shards), from the stats records."""
    from tasks.runtime.shards import read_stats, stats_path

    out = {}
    for stage in stages:
        spans = []
        for s in read_stats(root, source, stage):
            end = stats_path(root, source, stage, s.shard).stat().st_mtime
            spans.append((end - s.seconds, end))
        if spans:
            out[stage] = (min(a for a, _ in spans), max(b for _, b in spans), len(spans))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000, help="generated scenes")
    parser.add_argument("--shard-size", type=int, default=250, help="samples per fetch shard")
    parser.add_argument("--workers", type=int, default=None, help="the flow's worker budget")
    parser.add_argument("--keep", action="store_true", help="keep the data root")
    args = parser.parse_args()
    from bench.catalogs import demo_catalog

    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-bl-"))
    demo_catalog(work, args.images, args.shard_size)
    os.environ.setdefault("SDPIPE_DEVICE_LOCKS", str(work / "device-locks"))

    from flows.build_latents import STAGES, build_latents
    from flows.execution import pools
    from flows.execution.stages import DISPLAY
    from tasks.runtime.shards import read_stats

    root = work / "data"
    params = {"source": "demo", "data_root": str(root)}
    if "workers" in inspect.signature(build_latents.fn).parameters:  # not in older checkouts
        params["workers"] = args.workers
    start_wall = time.time()
    start = time.perf_counter()
    state = build_latents(**params, return_state=True)
    seconds = time.perf_counter() - start
    if not state.is_completed():
        raise SystemExit(f"build-latents failed: {state.message}")

    walls = stage_walls(root, "demo", [*STAGES, "views"])
    stages, samples = {}, sum(s.num_in for s in read_stats(root, "demo", "metadata"))
    kept = sum(s.num_out for s in read_stats(root, "demo", "latents"))
    print(f"build-latents demo: {samples} samples in, {kept} latents, {seconds:.1f} s wall")
    print(f"{'stage':<16}{'shards':>7}{'starts':>9}{'ends':>9}{'wall s':>9}")
    for stage, (first, last, n) in sorted(walls.items(), key=lambda kv: kv[1][0]):
        name = DISPLAY[stage]
        stages[name] = round(last - first, 1)
        print(
            f"{name:<16}{n:>7}{first - start_wall:>9.1f}{last - start_wall:>9.1f}"
            f"{stages[name]:>9.1f}"
        )
    revision = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        cwd=Path(sys.modules["flows"].__file__).parent,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if args.keep:
        print(f"data root kept: {root}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "build_latents",
                "seconds": round(seconds, 1),
                "stages": stages,
                "samples": samples,
                "latents": kept,
                "images": args.images,
                "shard_size": args.shard_size,
                "workers": params.get("workers"),
                "devices": pools.node_devices(),
                "revision": revision,
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
            }
        )
    )


if __name__ == "__main__":
    main()
