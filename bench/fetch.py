"""fetch-images vs img2dataset on a web-like loopback server; prints JSON last.

A loopback HTTP server (its own process, a thread per request) answers each request after a
web-like delay (uniform in [0.5, 1.5] x the mean latency) and counts the requests it holds at
once. It serves `--urls` URLs of real-size JPEGs (1024x768, multi-scale noise over a gradient,
q90: ~165 KB, ~9 ms to decode; `--unique` of them generated once into a cache under /tmp and
cycled, not timed). Both sides fetch the same URLs in the same run, each in a fresh process,
alternating when repeated:

- `sdpipe`: the fetch-images stage as build-latents runs it: the URLs split into filtered
  shards of `--shard-size`, `concurrency.fetch_shards()` shard tasks at once in a thread pool
  (as the flow's task runner), each `tasks.sources.fetch_images.fetch_images_shard` (records, keys,
  decode by the shared image rules, 512 px JPEG shards, sample tables, stats records).
- `img2dataset`: img2dataset called as its README recommends for this machine:
  `processes_count` = the cores, `thread_count` 128, webdataset output, resized to the same
  512 px center crop, the same shard size; its other options at their defaults.

Each side's time is its stage from a cold process: sdpipe's worker pools and img2dataset's
spawned processes start inside it; importing the orchestrating module (tasks.sources.fetch_images,
img2dataset) does not. `max_in_flight` is what the server saw at once during sdpipe's side.
`--tree PATH` runs sdpipe's side from another checkout (e.g. the code before a change).
Usage: python bench/fetch.py [--urls N] [--latency-ms MS] [--shard-size N] [--repeat R]
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/<x>.py` puts bench/ first on the path, where bench/tokenize.py would shadow the
# standard library's tokenize: the repository root (or --tree) takes its place.
REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)

import argparse
import http.server
import json
import os
import random
import resource
import subprocess
import tempfile
import threading
import time
import urllib.request

GOAL_RATIO = 0.9
WIDTH, HEIGHT, QUALITY = 1024, 768, 90
SIZE = 512
SOURCE = "bench"
I2D_THREADS = 128  # img2dataset's LAION examples: --thread_count 128
CACHE = Path(tempfile.gettempdir()) / "sdpipe-bench-fetch"


# ---- images (generated once, cached) ---------------------------------------------------------


def photo_like(rng, width: int, height: int):
    """Noise at every scale over a gradient: a JPEG about as large and costly as a photo."""
    import cv2
    import numpy as np

    out = np.zeros((height, width, 3), np.float32)
    for cell in (256, 64, 16, 4, 1):
        noise = rng.normal(size=(height // cell, width // cell, 3)).astype(np.float32)
        out += (cell**0.5 + 6) * cv2.resize(noise, (width, height), interpolation=cv2.INTER_CUBIC)
    out = (out - out.min()) / (out.max() - out.min()) * 160
    out += np.linspace(0, 95, width, dtype=np.float32)[None, :, None]
    return out.clip(0, 255).astype(np.uint8)


def image_folder(unique: int, width: int = WIDTH, height: int = HEIGHT) -> Path:
    folder = CACHE / f"{width}x{height}-q{QUALITY}-{unique}"
    if (folder / "done").exists():
        return folder
    import cv2
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(unique):
        ok, jpeg = cv2.imencode(
            ".jpg", photo_like(rng, width, height), [cv2.IMWRITE_JPEG_QUALITY, QUALITY]
        )
        assert ok
        (folder / f"{i:05d}.jpg").write_bytes(jpeg.tobytes())
    (folder / "done").write_text("")
    return folder


# ---- the server (its own process: its threads never hold either side's GIL) -----------------


def serve(folder: Path, latency_ms: float) -> None:
    """`/img/N.jpg` -> image N mod unique after the delay; `/stats` the counts; `/reset`."""
    data = [p.read_bytes() for p in sorted(folder.glob("*.jpg"))]
    lock = threading.Lock()
    state = {"in_flight": 0, "max_in_flight": 0, "requests": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            if self.path in ("/stats", "/reset"):
                with lock:
                    body = json.dumps(state).encode()
                    if self.path == "/reset":
                        state.update(max_in_flight=state["in_flight"], requests=0)
                return self._send(body, "application/json")
            with lock:
                state["in_flight"] += 1
                state["requests"] += 1
                state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                time.sleep(latency_ms / 1000 * random.uniform(0.5, 1.5))
                n = int(self.path.rsplit("/", 1)[-1].split(".")[0])
                self._send(data[n % len(data)], "image/jpeg")
            finally:
                with lock:
                    state["in_flight"] -= 1

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 4096  # thousands of connections may arrive at once
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


# ---- the two sides (each in a fresh process) -------------------------------------------------


def urls_table(base: str, n: int):
    import pyarrow as pa

    return pa.table(
        {
            "key": [f"{i:012d}" for i in range(n)],
            "url": [f"{base}/img/{i}.jpg" for i in range(n)],
            "caption": [f"image {i}" for i in range(n)],
        }
    )


def run_sdpipe(work: Path, base: str, n: int, shard_size: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    from tasks.sources import fetch_images

    try:
        from tasks.runtime.concurrency import fetch_shards
    except ImportError:  # a checkout from before tasks.runtime.concurrency: the flow's 2 threads
        fetch_shards = lambda: 2  # noqa: E731

    table = urls_table(base, n)
    root = work / "data"
    filtered = root / SOURCE / "filtered"
    filtered.mkdir(parents=True)
    shards = []
    for first in range(0, n, shard_size):
        shards.append(f"{first // shard_size:05d}")
        pq.write_table(table.slice(first, shard_size), filtered / f"{shards[-1]}.parquet")
    at_once = fetch_shards()
    start = time.perf_counter()
    with ThreadPoolExecutor(at_once) as pool:
        stats = list(
            pool.map(
                lambda s: fetch_images.fetch_images_shard(
                    root, SOURCE, s, image_size=SIZE, min_side=0, allow_private_hosts=True
                ),
                shards,
            )
        )
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "ok": sum(s.num_out for s in stats), "fetch_shards": at_once}
    if hasattr(fetch_images, "parallelism"):  # the node's downloader processes and threads
        out["processes"], out["threads"] = fetch_images.parallelism()
    else:  # before: one img2dataset call per shard, 1 process of 16 threads
        out["processes"], out["threads"] = at_once, 16
    return out


def run_img2dataset(work: Path, base: str, n: int, shard_size: int, cores: int) -> dict:
    import pyarrow.parquet as pq
    from img2dataset import download

    pq.write_table(urls_table(base, n), work / "urls.parquet")
    start = time.perf_counter()
    download(
        url_list=str(work / "urls.parquet"),
        input_format="parquet",
        url_col="url",
        caption_col="caption",
        output_folder=str(work / "out"),
        output_format="webdataset",
        processes_count=cores,
        thread_count=I2D_THREADS,
        image_size=SIZE,
        resize_mode="center_crop",
        number_sample_per_shard=shard_size,
        enable_wandb=False,
    )
    seconds = time.perf_counter() - start
    ok = sum(json.loads(p.read_text())["successes"] for p in (work / "out").glob("*_stats.json"))
    return {"seconds": seconds, "ok": ok, "processes": cores, "threads": I2D_THREADS}


def side(name: str, args, base: str, tree: Path) -> dict:
    """One side in a fresh process (cold pools), with the server's counts around it."""
    get_json(f"{base}/reset")
    with tempfile.TemporaryDirectory(prefix=f"bench-fetch-{name}-") as work:
        cmd = [sys.executable, __file__, "--side", name, "--work", work, "--base", base]
        cmd += ["--urls", str(args.urls), "--shard-size", str(args.shard_size)]
        cmd += ["--tree", str(tree)]
        env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_MODE": "disabled"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    stats = get_json(f"{base}/stats")
    result.update(max_in_flight=stats["max_in_flight"], requests=stats["requests"])
    # CPU-seconds of the side's whole process tree (its children are waited for, so counted),
    # start-up and imports included: a figure that the machine's other load barely moves.
    result["cpu_s"] = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
    result["images_per_s"] = result["ok"] / result["seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--urls", type=int, default=4000)
    parser.add_argument("--latency-ms", type=float, default=200)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--unique", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout of sdpipe's side")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("sdpipe", "img2dataset"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))

    if args.serve:
        return serve(args.serve, args.latency_ms)
    if args.side:
        sys.path[0] = str(args.tree.resolve())
        if args.side == "sdpipe":
            result = run_sdpipe(args.work, args.base, args.urls, args.shard_size)
        else:
            result = run_img2dataset(args.work, args.base, args.urls, args.shard_size, cores)
        print(json.dumps(result))
        return None

    folder = image_folder(args.unique)
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(folder), "--latency-ms", str(args.latency_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        runs: dict[str, list[dict]] = {"sdpipe": [], "img2dataset": []}
        for r in range(args.repeat):  # alternating, so both see the same machine
            order = ("sdpipe", "img2dataset") if r % 2 == 0 else ("img2dataset", "sdpipe")
            for name in order:
                res = side(name, args, base, args.tree)
                runs[name].append(res)
                print(
                    f"{name:12s} run {r + 1}: {res['ok']}/{args.urls} images in "
                    f"{res['seconds']:.1f} s = {res['images_per_s']:.1f} images/s, "
                    f"max {res['max_in_flight']} requests in flight, "
                    f"{res['cpu_s']:.0f} CPU-s in all ({1000 * res['cpu_s'] / args.urls:.1f} ms "
                    "per URL)",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait()
    best = {name: max(rs, key=lambda x: x["images_per_s"]) for name, rs in runs.items()}
    sd, i2d = best["sdpipe"], best["img2dataset"]
    ratio = sd["images_per_s"] / i2d["images_per_s"]
    print(
        f"best of {args.repeat}: sdpipe {sd['images_per_s']:.1f} images/s, img2dataset "
        f"{i2d['images_per_s']:.1f} images/s, ratio {ratio:.2f} (goal >= {GOAL_RATIO})"
    )
    print(
        json.dumps(
            {
                "bench": "fetch",
                "urls": args.urls,
                "latency_ms": args.latency_ms,
                "shard_size": args.shard_size,
                "image": f"{WIDTH}x{HEIGHT} q{QUALITY}",
                "output_side": SIZE,
                "sdpipe_images_per_s": round(sd["images_per_s"], 1),
                "img2dataset_images_per_s": round(i2d["images_per_s"], 1),
                "ratio": round(ratio, 3),
                "goal_ratio": GOAL_RATIO,
                "met": ratio >= GOAL_RATIO,
                "max_in_flight": sd["max_in_flight"],
                "img2dataset_max_in_flight": i2d["max_in_flight"],
                "sdpipe_ok": sd["ok"],
                "img2dataset_ok": i2d["ok"],
                "sdpipe_cpu_ms_per_url": round(1000 * sd["cpu_s"] / args.urls, 2),
                "img2dataset_cpu_ms_per_url": round(1000 * i2d["cpu_s"] / args.urls, 2),
                "sdpipe_s": round(sd["seconds"], 2),
                "img2dataset_s": round(i2d["seconds"], 2),
                "sdpipe_runs": [round(x["images_per_s"], 1) for x in runs["sdpipe"]],
                "img2dataset_runs": [round(x["images_per_s"], 1) for x in runs["img2dataset"]],
                "fetch_shards": sd.get("fetch_shards"),
                "sdpipe_processes": sd.get("processes"),
                "sdpipe_threads": sd.get("threads"),
                "img2dataset_processes": i2d["processes"],
                "img2dataset_threads": i2d["threads"],
                "tree": str(args.tree.resolve()),
                "cores": cores,
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )
    return None


if __name__ == "__main__":
    main()
