"""The built-in demo source: procedural captioned scenes served by a loopback HTTP server.

The mirror looks like a LAION download (a metadata parquet of URLs and scores) and plants
the faults real data has: duplicate URLs, duplicate bytes under another URL, a 404, bytes
that are not an image, images under the size floor, and rows failing each score threshold.
`PLANTED` says how many of each, so tests and the demo can check every drop is accounted for.
The scenes are square, landscape (3:2) and portrait (2:3) (`FRAMES`), each side at least 160
px: above the demo profile's 128 px floor and over twice the demo resolution (64).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from sdtrain.atomic import atomic_path
from tasks.runtime.net import free_port, serving

SKIES = {"blue": (90, 150, 230), "orange sunset": (240, 140, 60), "dark night": (20, 20, 50)}
GROUNDS = {
    "green grass": (60, 160, 60),
    "yellow sand": (220, 200, 120),
    "white snow": (240, 240, 245),
}
COLORS = {
    "red": (220, 30, 30),
    "blue": (30, 60, 220),
    "purple": (140, 40, 170),
    "black": (15, 15, 15),
    "pink": (250, 130, 190),
}
SHAPES = ("circle", "square", "triangle")
# The scenes' frames, in turn (width:height): 3 of 5 square, 1 landscape 3:2, 1 portrait 2:3,
# so the demo's shards hold the aspect ratios that bucketed training sorts into buckets.
FRAMES = ((1, 1), (1, 1), (1, 1), (3, 2), (2, 3))

# Planted faults: reason the pipeline must report -> number of rows.
PLANTED = {
    "duplicate_url": 6,  # the same URL listed twice
    "duplicate_sha256": 4,  # the same bytes under a second URL
    "http_404": 3,
    "decode_error": 2,  # bytes that are not an image
    "too_small": 6,  # 4 declared small in the metadata, 2 that lie about their size
    "aesthetic": 4,
    "similarity": 4,
    "pwatermark": 4,
    "punsafe": 4,
}


def draw_scene(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    """One procedural scene and the caption that describes it."""
    sky, ground, color = (rng.choice(list(d)) for d in (SKIES, GROUNDS, COLORS))
    shape = rng.choice(SHAPES)
    img = Image.new("RGB", (width, height), SKIES[sky])
    draw = ImageDraw.Draw(img)
    horizon = int(height * rng.uniform(0.55, 0.75))
    draw.rectangle([0, horizon, width, height], fill=GROUNDS[ground])
    size = int(min(width, height) * rng.uniform(0.2, 0.35))
    cx = int(width * rng.uniform(0.3, 0.7))
    cy = horizon - size // 2 - int(rng.uniform(0, 0.2) * height)
    box = [cx - size // 2, cy - size // 2, cx + size // 2, cy + size // 2]
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:
        draw.polygon([(box[0], box[3]), (box[2], box[3]), (cx, box[1])], fill=COLORS[color])
    return img, f"a {color} {shape} above {ground} under a {sky} sky"


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def generate_mirror(dest: Path, *, num_images: int, seed: int) -> Path:
    """Write the mirror under `dest` (images/, metadata/part-00000.parquet, server.json).

    Built in a temporary folder and renamed into place, so a killed run leaves no half mirror.
    """
    if (dest / "server.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp:
        shutil.rmtree(tmp, ignore_errors=True)
        _write_mirror(tmp, num_images=num_images, seed=seed, port=free_port())
    return dest


def _write_mirror(root: Path, *, num_images: int, seed: int, port: int) -> None:
    rng = np.random.default_rng(seed)
    images = root / "images"
    images.mkdir(parents=True)
    base = f"http://127.0.0.1:{port}/images"
    rows: list[dict] = []

    def add(name: str, caption: str, w: int, h: int, **scores) -> dict:
        row = {
            "URL": f"{base}/{name}",
            "TEXT": caption,
            "WIDTH": float(w),
            "HEIGHT": float(h),
            "similarity": float(rng.uniform(0.28, 0.4)),
            "punsafe": float(rng.uniform(0, 0.1)),
            "pwatermark": float(rng.uniform(0, 0.3)),
            "aesthetic": float(rng.uniform(5.2, 7.5)),
            "hash": int(rng.integers(-(2**62), 2**62)),
        }
        row.update(scores)
        rows.append(row)
        return row

    frames = itertools.cycle(FRAMES)

    def scene(name: str, w: int | None = None, h: int | None = None) -> tuple[str, int, int]:
        if w is None or h is None:
            unit = int(rng.integers(80, 161))  # the short side 2 * unit: 160..320 px
            fw, fh = next(frames)
            w, h = fw * 2 * unit // min(fw, fh), fh * 2 * unit // min(fw, fh)
        img, caption = draw_scene(rng, w, h)
        (images / name).write_bytes(_jpeg(img))
        return caption, w, h

    for i in range(num_images):
        name = f"{i:05d}.jpg"
        caption, w, h = scene(name)
        add(name, caption, w, h)
    good = list(rows)
    # Same URL listed again (exact duplicate rows).
    for row in good[: PLANTED["duplicate_url"]]:
        rows.append(dict(row))
    # Same bytes under another URL.
    for i, row in enumerate(good[10 : 10 + PLANTED["duplicate_sha256"]]):
        name = f"copy-{i}.jpg"
        shutil.copy(images / row["URL"].rsplit("/", 1)[1], images / name)
        add(name, row["TEXT"], int(row["WIDTH"]), int(row["HEIGHT"]))
    for i in range(PLANTED["http_404"]):
        add(f"missing-{i}.jpg", "a photo that is gone", 256, 256)
    for i in range(PLANTED["decode_error"]):
        name = f"not-an-image-{i}.jpg"
        (images / name).write_bytes(b"<html>this is an error page, not a JPEG</html>\n" * 20)
        add(name, "a broken image", 256, 256)
    # Under the size floor: declared small (filtered before download) ...
    for i in range(4):
        name = f"small-{i}.jpg"
        caption, w, h = scene(name, 96, 96)
        add(name, caption, w, h)
    # ... and declared large but actually small (caught after download).
    for i in range(2):
        name = f"liar-{i}.jpg"
        caption, _, _ = scene(name, 100, 90)
        add(name, caption, 256, 256)
    failing = {"aesthetic": 3.0, "similarity": 0.1, "pwatermark": 0.9, "punsafe": 0.95}
    for column, value in failing.items():
        for i in range(PLANTED[column]):
            name = f"{column}-{i}.jpg"
            caption, w, h = scene(name)
            add(name, caption, w, h, **{column: value})
    order = rng.permutation(len(rows))
    table = pa.Table.from_pylist([rows[i] for i in order])
    (root / "metadata").mkdir()
    pq.write_table(table, root / "metadata" / "part-00000.parquet")
    (root / "server.json").write_text(json.dumps({"host": "127.0.0.1", "port": port}))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would drown the logs
        pass


@contextlib.contextmanager
def serve_mirror(mirror: Path) -> Iterator[str]:
    """Serve the mirror on the loopback port its URLs name, for the duration of the block."""
    info = json.loads((mirror / "server.json").read_text())
    handler = functools.partial(_QuietHandler, directory=str(mirror))
    stack = contextlib.ExitStack()
    try:
        url = stack.enter_context(serving(handler, info["host"], info["port"]))
    except OSError as e:
        raise RuntimeError(
            f"demo server: port {info['port']} (named by the URLs in {mirror}) is busy: {e}"
        ) from None
    with stack:
        yield url
