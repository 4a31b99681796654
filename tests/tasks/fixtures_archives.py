"""Running an archive adapter through the real stages on a generated mirror, and checking what
it wrote: shared by the adapter tests.

`run_chain` is index_source -> repack_shard (every shard) -> tokenize_shard, each through the
adapter's fsspec location; `http_mirror` serves a mirror folder on a loopback port so the
location can be `http://127.0.0.1:<port>` (remote archives are then copied under raw/).
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import FilterProfile, Source, buckets
from tasks.runtime.net import free_port
from tasks.runtime.shards import ShardStats
from tasks.sources import demo_source
from tasks.sources.adapters import adapter_for
from tasks.sources.adapters.base import index_source, repack_shard, shard_names


@contextlib.contextmanager
def http_mirror(folder: Path) -> Iterator[str]:
    """`http://127.0.0.1:<port>` serving `folder` (no range requests, like a plain mirror)."""
    (folder / "server.json").write_text(json.dumps({"host": "127.0.0.1", "port": free_port()}))
    with demo_source.serve_mirror(folder) as url:
        yield url


def source(name: str, location: str, *, per_shard: int = 8, **options) -> Source:
    return Source(
        name=name,
        kind="archive",
        location=location,
        license="test",
        profile="x",
        resolution=64,
        samples_per_shard=per_shard,
        adapter=name,
        options=options,
    )


PROFILE = FilterProfile(name="x", min_side=64)


@dataclass
class Chain:
    index: ShardStats
    repack: list[ShardStats]
    tokens: list[ShardStats]
    rows: list[dict] = field(default_factory=list)  # every shard table row, in shard order

    def dropped(self, stage: str) -> Counter:
        stats = {"metadata": [self.index], "shards": self.repack, "tokens": self.tokens}[stage]
        return sum((Counter(s.dropped) for s in stats), Counter())

    def success(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "success"]


def run_chain(root: Path, src: Source, profile: FilterProfile = PROFILE) -> Chain:
    adapter = adapter_for(src, profile)
    index = index_source(root, src, adapter)
    repack, tokens, rows = [], [], []
    for shard in shard_names(root, src.name):
        repack.append(repack_shard(root, src, adapter, shard))
        table = pq.read_table(root / src.name / "shards" / f"{shard}.parquet")
        rows += table.to_pylist()
        # what filter-pixels would select with a profile that keeps every decoded image
        ok = [r for r in table.to_pylist() if r["status"] == "success"]
        selected = root / src.name / "selected" / f"{shard}.parquet"
        selected.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table(
                {
                    "key": pa.array([r["key"] for r in ok], pa.string()),
                    "caption": pa.array([r["caption"] for r in ok], pa.string()),
                }
            ),
            selected,
        )
        from tasks.latents.tokenize import tokenize_shard

        tokens.append(tokenize_shard(root, src.name, shard))
    for s in [index, *repack, *tokens]:
        s.check_balanced()
    return Chain(index, repack, tokens, rows)


def served_chain(root: Path, mirror: Path, served: str, name: str, **options) -> Chain:
    """`run_chain` over `mirror` read from its folder (`served` "local") or over a loopback
    HTTP server ("http"), with the source's `options`."""
    serving = http_mirror(mirror) if served == "http" else contextlib.nullcontext(str(mirror))
    with serving as location:
        return run_chain(root, source(name, location, **options))


def read_shard_tars(root: Path, name: str) -> dict[str, bytes]:
    """member name -> bytes of every shard tar of a source."""
    out = {}
    for tar_path in sorted((root / name / "shards").glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for info in tar:
                assert info.isfile(), info.name
                out[info.name] = tar.extractfile(info).read()
    return out


def check_shards(root: Path, chain: Chain, name: str, size: int = 64) -> dict[str, np.ndarray]:
    """The shard tars hold exactly key.jpg/.txt/.json of each success row, JPEGs of at most
    size² pixels with the image's aspect kept (`buckets.stored_size`), captions and JSON
    matching the table; returns key -> RGB pixels."""
    members = read_shard_tars(root, name)
    ok = chain.success()
    assert set(members) == {f"{r['key']}.{e}" for r in ok for e in ("jpg", "txt", "json")}
    pixels = {}
    for r in ok:
        bgr = cv2.imdecode(np.frombuffer(members[f"{r['key']}.jpg"], np.uint8), cv2.IMREAD_COLOR)
        stored_w, stored_h = buckets.stored_size(r["width"], r["height"], size)
        assert bgr is not None and bgr.shape == (stored_h, stored_w, 3), r["key"]
        pixels[r["key"]] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        assert members[f"{r['key']}.txt"].decode() == r["caption"]
        meta = json.load(io.BytesIO(members[f"{r['key']}.json"]))
        assert meta["key"] == r["key"] and meta["origin"] == r["origin"]
        assert (meta["width"], meta["height"], meta["sha256"]) == (
            r["width"],
            r["height"],
            r["sha256"],
        )
    return pixels


def close(rgb: np.ndarray, color, tol: int = 12) -> bool:
    return bool(np.all(np.abs(rgb.astype(int) - np.array(color)) <= tol))


def read_dir(folder: Path) -> pa.Table:
    """A stage folder's shard tables, in shard order (not its stats records)."""
    return pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("[0-9]*.parquet")))


def members(tar_path: Path) -> dict[str, bytes]:
    """Every member of a tar, by name."""
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}
