"""Fixtures for stage tests that start after fetch-images: a source's shards, written directly."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.runtime.net import serving
from tasks.sources import demo_source


def scene_jpeg(seed: int, side: int = 256, quality: int = 90) -> bytes:
    """A procedural demo scene as JPEG bytes (different seeds: far apart in pHash)."""
    img, _ = demo_source.draw_scene(np.random.default_rng(seed), side, side)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def write_fetched(
    root: Path,
    source: str,
    rows: list[dict],
    *,
    scores: dict[str, dict] | None = None,
    shard: str = "00000",
) -> None:
    """A source as fetch-images (and the score stage, given `scores`) leave it.

    rows: key, caption, width, height, image (bytes or None) and any other sample-table
    columns; status defaults to success, sha256 to the image's. scores: key -> aesthetic,
    similarity, pwatermark, punsafe, phash, embedding.
    """
    shards = root / source / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    table = []
    with tarfile.open(shards / f"{shard}.tar", "w") as tar:
        for row in rows:
            row = dict(row)
            image = row.pop("image", None)
            row.setdefault("status", "success")
            if image is not None:
                row.setdefault("sha256", hashlib.sha256(image).hexdigest())
                info = tarfile.TarInfo(f"{row['key']}.jpg")
                info.size = len(image)
                tar.addfile(info, io.BytesIO(image))
            table.append(row)
    pq.write_table(pa.Table.from_pylist(table), shards / f"{shard}.parquet")
    if scores is not None:
        keys = [k for k in (r["key"] for r in rows) if k in scores]
        dim = len(next(iter(scores.values()))["embedding"]) if scores else 4
        emb = np.array([scores[k]["embedding"] for k in keys], np.float16).reshape(-1, dim)
        out = {"key": pa.array(keys, pa.string())}
        for c in ("aesthetic", "similarity", "pwatermark", "punsafe"):
            out[c] = pa.array([scores[k].get(c, 0.5) for k in keys], pa.float32())
        out["phash"] = pa.array([scores[k].get("phash", 0) for k in keys], pa.uint64())
        out["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), dim)
        (root / source / "scores").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(out), root / source / "scores" / f"{shard}.parquet")


@pytest.fixture
def fetched():
    return write_fetched


@pytest.fixture
def scene():
    return scene_jpeg


def loopback_server(handler: type, request_queue_size: int = 5):
    """`handler` served on 127.0.0.1 (a free port) while the block runs: its base URL."""
    return serving(handler, request_queue_size=request_queue_size)
