"""encode-ray: the encode stage as Prefect tasks on a Ray cluster, each task holding one GPU.

A task takes `shards_per_task` shards so its pipeline reads the next shard while the GPU
encodes the current one, and resumes through the shard records like every stage: rerunning
the flow redoes only unfinished shards. Ray is the cluster at RAY_ADDRESS, else a local one.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import ray
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from catalog import Model, load_catalog
from flows.execution.cluster import forwarded_env
from flows.execution.stages import publish_counts
from tasks.latents import encode
from tasks.runtime import shards
from tasks.runtime.ray_connect import connect, disconnect
from tasks.runtime.shards import read_stats, summarize


class SdpipeRayTaskRunner(RayTaskRunner):
    """A RayTaskRunner whose workers get this process's Prefect API (they report their task
    runs to it), sdpipe settings and checkout (`flows.execution.cluster.forwarded_env`), read when
    the flow starts, not at import."""

    def __enter__(self):
        runtime_env = self.init_kwargs.setdefault("runtime_env", {})
        runtime_env["env_vars"] = {**forwarded_env(), **runtime_env.get("env_vars", {})}
        # Connected here (the cluster's token checked, an open connection kept), not by
        # RayTaskRunner, which then uses this connection and leaves closing it to __exit__.
        self.opened = connect(self.address, **self.init_kwargs)
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            super().__exit__(*exc_info)
        finally:
            if self.opened:
                disconnect()


# No Prefect result cache: the shard records are the cache, and they are never stale.
@task(name="encode-shards", cache_policy=NO_CACHE)
def encode_shards_task(
    root: str,
    source: str,
    shard_names: list[str],
    model: Model,
    *,
    batch_size: int,
    num_workers: int,
    compile: bool,
    spec: encode.LatentSpec | None = None,
) -> list[dict]:
    stats = encode.encode_shards(
        Path(root),
        source,
        shard_names,
        model,
        batch_size=batch_size,
        num_workers=num_workers,
        compile=compile,
        spec=spec,
    )
    return [asdict(s) for s in stats]


@task(name="latent-qa", cache_policy=NO_CACHE)
def latent_qa_task(root: str, source: str, model: Model, num_samples: int) -> dict:
    return encode.latent_qa(Path(root), source, model, num_samples=num_samples)


@flow(name="encode-ray", task_runner=SdpipeRayTaskRunner(), log_prints=True)
def encode_ray(
    source: str = "demo",
    data_root: str | None = None,
    gpus_per_task: float = 1,
    cpus_per_task: int = 16,
    shards_per_task: int = 4,
    batch_size: int = 32,
    compile: bool = False,
    qa_samples: int = 16,
):
    """Encode every tokenized shard of `source` on Ray, then decode a QA sample back.

    `cpus_per_task` cores feed each task's GPU: two for the VAE and I/O threads, the rest
    decode. Set `gpus_per_task=0` to run on CPUs (tests, laptops).
    """
    logger = get_run_logger()
    root = shards.data_root(data_root)
    catalog = load_catalog()
    model = catalog.model(catalog.source(source).model)
    spec = encode.spec_for(catalog, source)  # the catalog's bucket plan, flips, log-variance
    names = sorted(p.stem for p in (root / source / "tokens").glob("[0-9]*.parquet"))
    groups = [names[i : i + shards_per_task] for i in range(0, len(names), shards_per_task)]
    cluster = ray.cluster_resources()
    if cluster.get("GPU", 0) < gpus_per_task or cluster.get("CPU", 0) < cpus_per_task:
        logger.warning(
            "the Ray cluster has %s GPUs and %s CPUs; each encode task waits for %s and %s",
            cluster.get("GPU", 0),
            cluster.get("CPU", 0),
            gpus_per_task,
            cpus_per_task,
        )
    done: dict[str, dict] = {}
    failed: list[str] = []
    with remote_options(num_gpus=gpus_per_task, num_cpus=cpus_per_task):
        futures = [
            encode_shards_task.with_options(
                task_run_name=f"encode-{source}-{group[0]}-{group[-1]}"
            ).submit(
                str(root),
                source,
                group,
                model,
                batch_size=batch_size,
                num_workers=max(1, cpus_per_task - 2),
                compile=compile,
                spec=spec,
            )
            for group in groups
        ]
        for group, future in zip(groups, futures, strict=True):
            try:
                done |= {s["shard"]: s for s in future.result()}
            except Exception as e:  # a task's failure is reported; the other tasks go on
                failed.append(f"{group[0]}-{group[-1]}")
                logger.error("encode %s shards %s failed: %s", source, group, e)
        qa = latent_qa_task.submit(str(root), source, model, qa_samples).result() if done else None
    publish_counts(source, "encode", done)
    if qa is not None and qa["samples"]:
        create_markdown_artifact(
            qa_markdown(source, qa), key=f"{source}-latent-qa", description="latent QA"
        )
    if failed:
        return Failed(message=f"encode {source}: shard groups {', '.join(failed)} failed")
    return {"summary": summarize(read_stats(root, source, encode.STAGE)), "qa": qa}


def qa_markdown(source: str, qa: dict) -> str:
    lines = [
        f"# latent QA {source} ({qa['model']})",
        "",
        f"{qa['num_latents']} latents, mean {qa['latent_mean']:.4f}, std {qa['latent_std']:.4f}",
        f"reconstruction PSNR {qa['psnr_db_mean']:.2f} dB over {len(qa['samples'])} images "
        f"(seed {qa['seed']})",
        "",
        "| shard | key | PSNR dB |",
        "|---|---|---|",
    ]
    lines += [f"| {s['shard']} | {s['key']} | {s['psnr_db']:.2f} |" for s in qa["samples"]]
    return "\n".join(lines)


if __name__ == "__main__":
    encode_ray()
