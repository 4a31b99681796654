"""A node's worker budget as a budget: a LAION-kind build at workers = 2 and 4, before and after.

Each run is `sdpipe build-latents web --workers W` in a fresh process on a fresh data root: a
LAION-kind source (kind `url`, LAION's column dialect, `--images` JPEGs served on loopback,
scored by the random-weight `tiny-scoring` with its decode in processes as on a GPU node), so
fetch, score, tokenize and encode all run and overlap. The same runs go through the code before
the node object (`--before`, a git revision, exported with `git archive` into a temporary
folder and run with cwd and PYTHONPATH there), alternating, on one Prefect server. Every ~50 ms
the run's process tree is sampled: its CPU-heavy processes by role (downloaders, decode
workers, score decode workers, tokenize processes; not the flow's own process) and the summed
RSS of the whole tree. images/s is the latents' images over the run's wall time.

Prints a line per run and JSON last: `within_budget` 1 when every run of this code stayed
within workers + 2 CPU-heavy processes, `ratio` the worst images/s after / before.
Usage: python bench/node_budget.py [--workers 2,4] [--images N] [--repeat R] [--before main]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize: the repository root takes its place.
REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)

import argparse
import contextlib
import functools
import http.server
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

from tasks.runtime.net import serving

EXTRA = 2  # the budget's allowance over `workers` (tasks/runtime/node.py)
SAMPLE_S = 0.05
# A CPU-heavy process of a build by what it runs (before and after the node object).
ROLES = (
    ("tasks.sources.fetch_images", "downloader"),
    ("tasks.curation.score_decode", "score_decode"),
    ("tasks.latents.images", "decode"),
    ("tasks.runtime.calls", "tokenize"),
    ("multiprocessing.spawn", "tokenize"),  # before: tokenize's ProcessPoolExecutor
)


def role(cmdline: list[str]) -> str | None:
    text = " ".join(cmdline)
    for key, name in ROLES:
        if key in text:
            return name
    return None


class Sampler:
    """Peaks of a process tree while it runs: CPU-heavy processes (all, and by role) and the
    summed RSS of every process in it."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.peak, self.peak_rss, self.by_role = 0, 0, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            roles: dict[str, int] = {}
            rss = 0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    rss += p.memory_info().rss
                    if (r := role(p.cmdline())) is not None:
                        roles[r] = roles.get(r, 0) + 1
            heavy = sum(roles.values())
            if heavy > self.peak:
                self.peak, self.by_role = heavy, roles
            self.peak_rss = max(self.peak_rss, rss)
            self.stop.wait(SAMPLE_S)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        return {
            "peak_processes": self.peak,
            "at_peak": self.by_role,
            "peak_rss_gb": round(self.peak_rss / 2**30, 2),
        }


# ---- the source ------------------------------------------------------------------------------


def make_source(folder: Path, url: str, num_images: int, side: int) -> None:
    """`num_images` photo-like JPEGs under folder/img and two LAION-dialect metadata files."""
    import cv2
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    (folder / "img").mkdir(parents=True)
    rows = []
    for i in range(num_images):
        h, w = side * 3 // 4, side
        base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
        noise = cv2.resize(rng.normal(0, 40, (h // 8, w // 8, 3)).astype(np.float32), (w, h))
        pixels = np.clip(base + noise + rng.normal(0, 10, (h, w, 3)), 0, 255).astype(np.uint8)
        ok, data = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 90])
        (folder / "img" / f"{i}.jpg").write_bytes(data.tobytes())
        rows.append(
            {
                "URL": f"{url}/img/{i}.jpg",
                "TEXT": f"a photo number {i} of a gradient under noise",
                "WIDTH": float(w),
                "HEIGHT": float(h),
                "similarity": 0.3,
                "punsafe": 0.01,
                "pwatermark": 0.1,
                "aesthetic": 6.0,
            }
        )
    (folder / "metadata").mkdir()
    half = len(rows) // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part), folder / "metadata" / f"part-{i:05d}.parquet")


def make_catalog(dest: Path, location: Path, per_shard: int) -> Path:
    """The shipped catalog and a LAION-kind source `web`, scored by `tiny-scoring`."""
    import yaml

    from catalog.loader import PACKAGED_DIR

    shutil.copytree(PACKAGED_DIR, dest, ignore=shutil.ignore_patterns("*.py", "__pycache__"))

    def edit(name: str, key: str, value: dict) -> None:
        entries = yaml.safe_load((dest / name).read_text())
        entries[key] = value
        (dest / name).write_text(yaml.safe_dump(entries))

    edit(
        "sources.yaml",
        "web",
        {
            "kind": "url",
            "location": str(location),
            "license": "generated images",
            "profile": "web-scored",
            "samples_per_shard": per_shard,
            "resolution": 64,
            "model": "tiny",
            "allow_private_hosts": True,  # served on loopback
        },
    )
    edit(
        "profiles.yaml",
        "web-scored",
        {"min_aesthetic": 5.0, "min_side": 48, "dedup": ["url"], "scorer": "tiny-scoring"},
    )
    edit("datasets.yaml", "web", {"source": "web", "profile": "web-scored"})
    return dest


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve(folder: Path):
    return serving(functools.partial(_Quiet, directory=str(folder)))


# ---- one run ---------------------------------------------------------------------------------


def latents_out(root: Path) -> int:
    total = 0
    for p in (root / "web" / "latents").glob("*.stats.json"):
        total += json.loads(p.read_text())["num_out"]
    return total


def run(code: Path, workers: int, work: Path, catalog: Path, api: str, tag: str) -> dict:
    root = work / f"data-{tag}-{workers}"
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "SDPIPE_CATALOG": str(catalog),
        "SDPIPE_DATA": str(root),
        "PREFECT_API_URL": api,
        "SDPIPE_SCORE_DECODE": "processes",  # score's CPU side as on a GPU node
        "OMP_NUM_THREADS": "1",
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    for name in ("SDPIPE_WORKERS", "SDPIPE_TOKENIZE_PROCESSES", "SDPIPE_FETCH_PROCESSES"):
        env.pop(name, None)
    cmd = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main())"]
    cmd += ["build-latents", "web", "--workers", str(workers)]
    log = work / f"log-{tag}-{workers}.txt"
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid)
        proc.wait()
    seconds = time.perf_counter() - started
    peaks = sampler.finish()
    if proc.returncode != 0:
        raise SystemExit(f"{tag} workers={workers} failed:\n{log.read_text()[-4000:]}")
    images = latents_out(root)
    shutil.rmtree(root)
    return {
        "code": tag,
        "workers": workers,
        "images": images,
        "seconds": round(seconds, 1),
        "images_per_s": round(images / seconds, 2),
        **peaks,
        "within_budget": int(peaks["peak_processes"] <= workers + EXTRA),
    }


def export(revision: str, dest: Path) -> Path:
    """The tree of `revision` (git archive) in `dest`."""
    dest.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4", help="budgets, comma-separated")
    parser.add_argument("--images", type=int, default=192)
    parser.add_argument("--per-shard", type=int, default=24)
    parser.add_argument("--side", type=int, default=320, help="served JPEGs' width")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--before", default="main", help="the code before (a git revision)")
    args = parser.parse_args()
    budgets = [int(x) for x in args.workers.split(",")]

    from flows.cli import local
    from tasks.runtime.net import free_port

    work = Path(tempfile.mkdtemp(prefix="bench-node-budget-"))
    codes = {"before": export(args.before, work / "before"), "after": REPO}
    prefect_root = work / "prefect"
    port = free_port()
    os.environ["PREFECT_HOME"] = str(local.prefect_dir(prefect_root))
    runs: list[dict] = []
    try:
        with serve(work / "upstream") as url:
            make_source(work / "upstream", url, args.images, args.side)
            catalog = make_catalog(work / "catalog", work / "upstream" / "metadata", args.per_shard)
            local.ensure_server(prefect_root, port)
            for r in range(args.repeat):
                for workers in budgets:
                    order = ("before", "after") if r % 2 == 0 else ("after", "before")
                    for tag in order:
                        res = run(codes[tag], workers, work, catalog, local.api_url(port), tag)
                        runs.append(res)
                        print(json.dumps(res), flush=True)
    finally:
        local.stop(prefect_root)
        shutil.rmtree(work, ignore_errors=True)

    def best(tag: str, workers: int) -> dict:
        rs = [x for x in runs if x["code"] == tag and x["workers"] == workers]
        return max(rs, key=lambda x: x["images_per_s"])

    ratios = {
        str(w): round(best("after", w)["images_per_s"] / best("before", w)["images_per_s"], 3)
        for w in budgets
    }
    print(
        json.dumps(
            {
                "bench": "node_budget",
                "images": args.images,
                "per_shard": args.per_shard,
                "cores": len(os.sched_getaffinity(0)),
                "peak_processes": {
                    tag: {
                        str(w): max(
                            x["peak_processes"]
                            for x in runs
                            if x["code"] == tag and x["workers"] == w
                        )
                        for w in budgets
                    }
                    for tag in ("before", "after")
                },
                "peak_rss_gb": {
                    tag: {
                        str(w): max(
                            x["peak_rss_gb"] for x in runs if x["code"] == tag and x["workers"] == w
                        )
                        for w in budgets
                    }
                    for tag in ("before", "after")
                },
                "images_per_s": {
                    tag: {str(w): best(tag, w)["images_per_s"] for w in budgets}
                    for tag in ("before", "after")
                },
                "ratios": ratios,
                "within_budget": int(all(x["within_budget"] for x in runs if x["code"] == "after")),
                "before_within_budget": int(
                    all(x["within_budget"] for x in runs if x["code"] == "before")
                ),
                "ratio": min(ratios.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
