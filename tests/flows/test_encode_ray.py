"""encode-ray on a local Ray cluster writes what the single-process encoder writes."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from catalog import load_catalog
from tasks.latents import encode, latent_keys
from tasks.runtime.shards import ShardStats

pytestmark = pytest.mark.slow

SOURCE = "demo"  # the catalog source whose model (tiny) the flow looks up
SHARDS = ("00000", "00001", "00002")


def write_tokenized_shards(root: Path) -> None:
    """Three shards of five JPEGs (one of them broken) and their token tables."""
    rng = np.random.default_rng(0)
    for stage in ("shards", "tokens"):
        (root / SOURCE / stage).mkdir(parents=True)
    for shard in SHARDS:
        keys = [f"{shard}{i:04d}" for i in range(5)]
        with tarfile.open(root / SOURCE / "shards" / f"{shard}.tar", "w") as tar:
            for i, key in enumerate(keys):
                buf = io.BytesIO()
                pixels = rng.integers(0, 256, (rng.integers(64, 160), 96, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(buf, format="JPEG")
                data = buf.getvalue() if i != 3 else b"not a jpeg"
                info = tarfile.TarInfo(f"{key}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        ids = pa.array([[0] * 77] * len(keys), pa.list_(pa.int32(), 77))
        pq.write_table(
            pa.table({"key": keys, "input_ids": ids}), root / SOURCE / "tokens" / f"{shard}.parquet"
        )


def test_encode_ray_flow_equals_the_single_process_path(prefect_stack, tmp_path):
    from prefect.logging.handlers import APILogWorker

    from flows.encode_ray import SdpipeRayTaskRunner, encode_ray

    on_ray, single = tmp_path / "ray", tmp_path / "single"
    for root in (on_ray, single):
        write_tokenized_shards(root)
    catalog = load_catalog()
    # The reference encodes under the layout the flow takes from the catalog (its source's
    # model's bucket plan, its phase's flips, its latent sampling).
    spec = encode.spec_for(catalog, SOURCE)
    model = catalog.model(catalog.source(SOURCE).model)
    encode.encode_shards(single, SOURCE, SHARDS, model, batch_size=4, spec=spec)

    runner = SdpipeRayTaskRunner(init_kwargs={"num_cpus": 2, "include_dashboard": False})
    result = encode_ray.with_options(task_runner=runner)(
        source=SOURCE,
        data_root=str(on_ray),
        gpus_per_task=0,
        cpus_per_task=1,
        shards_per_task=2,
        batch_size=4,
        qa_samples=3,
    )
    APILogWorker.drain_all()  # this process's run logs, sent while the session's server is up

    assert result["summary"]["num_out"] == 12
    assert result["summary"]["dropped"] == {"decode_error": 3}
    for shard in SHARDS:
        ray_stats = ShardStats.read(on_ray / SOURCE / "latents" / f"{shard}.stats.json")
        ref_stats = ShardStats.read(single / SOURCE / "latents" / f"{shard}.stats.json")
        assert (ray_stats.num_out, ray_stats.dropped) == (ref_stats.num_out, ref_stats.dropped)
        assert latent_keys.read(on_ray, SOURCE, shard).equals(
            latent_keys.read(single, SOURCE, shard)
        )
        assert ray_stats.extra["latent_spec"] == ref_stats.extra["latent_spec"] == spec.to_dict()
        assert ray_stats.extra.get("buckets") == ref_stats.extra.get("buckets")
        files = sorted(p.name for p in (single / SOURCE / "latents").glob(f"{shard}.*.npy"))
        assert files == sorted(p.name for p in (on_ray / SOURCE / "latents").glob(f"{shard}.*.npy"))
        if spec.legacy:
            files = [f"{shard}.npy"]
        assert files
        for name in files:
            # Ray runs a task with one thread, the reference with two: equal to fp16 precision.
            np.testing.assert_allclose(
                np.load(on_ray / SOURCE / "latents" / name),
                np.load(single / SOURCE / "latents" / name),
                rtol=2e-3,
                atol=2e-3,
            )
    qa = json.loads((on_ray / SOURCE / "latents" / encode.QA_FILE).read_text())
    assert qa == result["qa"]
    assert len(qa["samples"]) == 3 and qa["num_latents"] == 12
