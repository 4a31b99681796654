"""build-latents as users run it on a LAION-kind source, not the demo: a catalog entry of kind
`url` with no scorer, LAION's column dialect over two metadata files, several shards, images
served on loopback with the awkward ones real data holds (EXIF-rotated, 16-bit, zero-byte, a
bomb, a 404, a `file://` row), run in a fresh process (`sdpipe build-latents`, the first use of
every lazily built object from the flow's task threads). Then the stage folders are deleted,
as an edited build profile's message tells users to, and the rebuild gives the same counts
and the same latents: nothing is answered "done" from a cache whose outputs are gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli import local
from tasks.latents import images, latent_keys
from tasks.runtime.shards import read_stats
from tests.tasks import bad_images as bad
from tests.tasks.conftest import scene_jpeg
from tests.tasks.fixtures_archives import http_mirror

pytestmark = pytest.mark.slow

STAGE_FOLDERS = ("metadata", "filtered", "shards", "selected", "views", "tokens", "latents")
ARROW = np.zeros((96, 80, 3), np.uint8)
ARROW[:48] = bad.RED  # the top half red, as displayed


def write_catalog(folder: Path, small_catalog: Path, location: Path) -> Path:
    catalog = folder / "catalog"
    shutil.copytree(small_catalog, catalog)
    sources = yaml.safe_load((catalog / "sources.yaml").read_text())
    sources["web"] = {  # as a user adds a LAION-like source (loopback: private hosts allowed)
        "kind": "url",
        "location": str(location),
        "license": "test images",
        "profile": "web-broad",
        "samples_per_shard": 8,
        "resolution": 64,
        "model": "tiny",
        "allow_private_hosts": True,
    }
    (catalog / "sources.yaml").write_text(yaml.safe_dump(sources))
    profiles = yaml.safe_load((catalog / "profiles.yaml").read_text())
    profiles["web-broad"] = {"min_aesthetic": 5.0, "min_side": 48, "dedup": ["url", "sha256"]}
    (catalog / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    datasets = yaml.safe_load((catalog / "datasets.yaml").read_text())
    datasets["web"] = {"source": "web", "profile": "web-broad"}
    (catalog / "datasets.yaml").write_text(yaml.safe_dump(datasets))
    return catalog


def upstream(folder: Path, url: str) -> dict[str, str]:
    """Two LAION-dialect metadata files; returns caption -> expected outcome."""
    images_dir = folder / "img"
    images_dir.mkdir(parents=True)
    rows, expected = [], {}

    def add(name: str, data: bytes | None, outcome: str, *, aesthetic=6.0, link=None):
        if data is not None:
            (images_dir / name).write_bytes(data)
        caption = f"a picture called {name}"
        rows.append(
            {
                "URL": link or f"{url}/img/{name}",
                "TEXT": caption,
                "WIDTH": 640.0,
                "HEIGHT": 480.0,
                "similarity": 0.3,
                "punsafe": 0.01,
                "pwatermark": 0.1,
                "aesthetic": aesthetic,
            }
        )
        expected[caption] = outcome

    for i in range(14):
        add(f"scene-{i}.jpg", scene_jpeg(100 + i, side=128), "success")
    add("exif.jpg", bad.exif_rotated_jpeg(ARROW, 6), "success")
    add("gray16.png", bad.gray16_png(level=200), "success")
    add("zero.jpg", bad.zero_bytes(), "decode_error")
    add("bomb.png", bad.png_bomb(), "too_large")
    add("gone.jpg", None, "http_404")
    add("dull.jpg", scene_jpeg(99, side=128), "aesthetic", aesthetic=3.0)
    add("local.jpg", None, "bad_url_scheme", link="file:///etc/passwd")
    meta = folder / "metadata"
    meta.mkdir()
    half = len(rows) // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part), meta / f"part-{i:05d}.parquet")
    return expected


def build(tmp_path: Path, catalog: Path, port: int) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SDPIPE_CATALOG": str(catalog),
        "SDPIPE_DATA": str(tmp_path / "data"),
        "PREFECT_API_URL": local.api_url(port),
        "OMP_NUM_THREADS": "1",
    }
    script = Path(sys.executable).with_name("sdpipe")  # the console script users run
    return subprocess.run(
        [str(script), "build-latents", "web"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def latent_files(root: Path) -> dict[str, bytes]:
    """The bytes of every latent file (`NNNNN.npy`, or `NNNNN.WxH.npy` per bucket)."""
    return {p.name: p.read_bytes() for p in (root / "web" / "latents").glob("*.npy")}


def counts(root: Path) -> dict[str, dict]:
    out = {}
    for stage in STAGE_FOLDERS:
        stats = read_stats(root, "web", stage)
        dropped: dict[str, int] = {}
        for s in stats:
            for reason, n in s.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + n
        out[stage] = {
            "shards": len(stats),
            "in": sum(s.num_in for s in stats),
            "out": sum(s.num_out for s in stats),
            "dropped": dropped,
        }
    return out


def test_a_laion_kind_source_builds_in_a_fresh_process_and_rebuilds(
    tmp_path, prefect_stack, small_catalog
):
    _, port = prefect_stack
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    with http_mirror(mirror) as url:
        expected = upstream(mirror, url)
        catalog = write_catalog(tmp_path, small_catalog, mirror / "metadata")
        first = build(tmp_path, catalog, port)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        root = tmp_path / "data"
        before = counts(root)
        latents = latent_files(root)
        # Keys of every shard encoded (one that kept no image has them, but no bucket file).
        records = read_stats(root, "web", "latents")
        keys = {r.shard: latent_keys.read(root, "web", r.shard) for r in records}
        shard_tables = pa.concat_tables(
            pq.read_table(p) for p in sorted((root / "web" / "shards").glob("[0-9]*.parquet"))
        ).to_pylist()

        # Every sample where it belongs, under the reason real data gives it.
        assert before["metadata"]["dropped"] == {"bad_url_scheme": 1}
        assert before["filtered"]["dropped"] == {"aesthetic": 1}
        assert before["shards"]["dropped"] == {"decode_error": 1, "too_large": 1, "http_404": 1}
        assert {r["caption"]: r["status"] for r in shard_tables if r["status"] != "success"} == {
            c: o for c, o in expected.items() if o not in ("success", "aesthetic", "bad_url_scheme")
        }
        assert before["filtered"]["out"] == 19 and before["shards"]["shards"] == 3
        assert before["tokens"]["shards"] == 3 and before["latents"]["out"] == 16
        for stage, c in before.items():
            if c["shards"]:
                assert c["in"] == c["out"] + sum(c["dropped"].values()), stage

        # The awkward images were decoded by the one rule set: upright, not white.
        tars = {}
        for tar in sorted((root / "web" / "shards").glob("*.tar")):
            with tarfile.open(tar) as t:
                tars |= {m.name: t.extractfile(m).read() for m in t}
        by_caption = {r["caption"]: r["key"] for r in shard_tables}
        upright = images.decode_image(tars[f"{by_caption['a picture called exif.jpg']}.jpg"], 64)
        assert upright[:16, ..., 0].mean() > 150 and upright[-16:, ..., 0].mean() < 60
        gray = images.decode_image(tars[f"{by_caption['a picture called gray16.png']}.jpg"], 64)
        assert abs(int(gray.mean()) - 200) <= 3

        # The stage folders deleted (what ProfileChanged tells users to do): a full rebuild,
        # not cached "done"s over nothing.
        for stage in STAGE_FOLDERS:
            shutil.rmtree(root / "web" / stage)
        again = build(tmp_path, catalog, port)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    after = counts(root)
    assert after == before
    assert latent_files(root) == latents
    # Each of the 3 shards: the bucket files its record names (the tiny model's plan; none for a
    # shard that kept no image), all 16 latents among them, and the same keys (bucket and row of
    # each) as the first build.
    records = read_stats(root, "web", "latents")
    assert sorted(keys) == [r.shard for r in records] and len(records) == 3
    for r in records:
        assert keys[r.shard].num_rows == r.num_out == sum(r.extra["buckets"].values())
    assert sorted(latents) == sorted(
        f"{r.shard}.{b}.npy" for r in records for b in r.extra["buckets"]
    )
    assert sum(n for r in records for n in r.extra["buckets"].values()) == 16
    for shard, table in keys.items():
        assert latent_keys.read(root, "web", shard).equals(table)
