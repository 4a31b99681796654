"""Throughput of each build-latents stage on the demo source, through the real flow.

Runs `build-latents` on a fresh data root (a temporary Prefect server unless PREFECT_API_URL
is set) and reads each stage's busy time from its stats records. Prints one JSON object.
Usage: python bench/demo_chain.py [--images N]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize (imported by torch): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import platform
import shutil
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=240)
    args = parser.parse_args()
    from bench.catalogs import demo_catalog

    work = Path(tempfile.mkdtemp(prefix="sdpipe-bench-"))
    demo_catalog(work, args.images)

    from flows.build_latents import STAGES, build_latents
    from flows.execution.stages import DISPLAY
    from tasks.runtime.shards import read_stats

    root = work / "data"
    start = time.perf_counter()
    state = build_latents(source="demo", data_root=str(root), return_state=True)
    seconds = time.perf_counter() - start
    if not state.is_completed():
        raise SystemExit(f"build-latents failed: {state.message}")
    stages = {}
    for stage in STAGES:
        stats = read_stats(root, "demo", stage)
        busy = sum(s.seconds for s in stats)
        num_in = sum(s.num_in for s in stats)
        stages[DISPLAY[stage]] = {
            "shards": len(stats),
            "samples_in": num_in,
            "busy_seconds": round(busy, 3),
            "samples_per_s": round(num_in / busy, 1) if busy else None,
        }
    shutil.rmtree(work)
    print(
        json.dumps(
            {
                "bench": "demo_chain",
                "images": args.images,
                "flow_seconds": round(seconds, 1),
                "stages": stages,
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
            }
        )
    )


if __name__ == "__main__":
    main()
