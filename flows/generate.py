"""generate: prompts x seeds -> PNG files + index.parquet, from a trained run's weights.

On one machine the batch holds slots of the node's GPU pool and one worker runs on each device
those slots claim (flows/execution/pools.py), so it never shares a GPU with score, encode or
training. With RAY_ADDRESS set it runs on that Ray cluster instead (Ray Data, one actor per GPU),
where Ray owns the GPUs. Rerunning a batch makes only the images its folder lacks.
"""

from __future__ import annotations

import base64
import io
import os
import time
from collections import Counter
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from flows.execution import pools
from flows.execution.stages import PROGRESS_EVERY_S, artifact_key
from sdtrain.sampling import image_grid
from sdtrain.weights import WeightsNotFound
from tasks.generation import generate as gen
from tasks.runtime import shards

SHEET_IMAGES = 8  # thumbnails on the summary artifact
SHEET_SIDE = 128


def preflight(prompts_file: str | Path, weights: str | Path, root: Path) -> tuple[list[str], Path]:
    """The prompts and the weights folder, or a one-line GenerateError / WeightsNotFound."""
    return gen.read_prompts(prompts_file), gen.find_weights(weights, root)


def _in_root(path: str | Path, root: Path) -> Path:
    """A deployment run's relative paths are under the data root, not the worker's folder."""
    return root / Path(path)


@task(name="generate-images", cache_policy=NO_CACHE)  # the files are the cache
def generate_task(
    prompts: list[str],
    weights: Path,
    out_dir: Path,
    *,
    seeds: list[int],
    settings: gen.Settings,
    use_ema: bool,
    batch_size: int,
    num_devices: int | None,
) -> dict:
    logger = get_run_logger()
    key = artifact_key("generate", out_dir.name)
    progress_id = create_progress_artifact(
        0.0, key=f"{key}-progress", description=f"generate {out_dir}: images done"
    )
    first: dict[str, float] = {}  # images there and time when the batch got its devices
    last_update = 0.0

    def on_progress(done: int, total: int) -> None:
        nonlocal last_update
        first.setdefault("already_there", done)
        first.setdefault("start", time.monotonic())
        if done == total or time.monotonic() - last_update >= PROGRESS_EVERY_S:
            update_progress_artifact(progress_id, 100.0 * done / total)
            last_update = time.monotonic()

    kwargs = dict(
        settings=settings, use_ema=use_ema, batch_size=batch_size, on_progress=on_progress
    )
    if os.environ.get("RAY_ADDRESS"):
        logger.info("on the Ray cluster at %s", os.environ["RAY_ADDRESS"])
        index = _on_ray(prompts, weights, out_dir, seeds, num_devices, kwargs)
    else:
        wanted = num_devices or len(pools.node_devices())
        logger.info("waiting for %d device(s) of the GPU pool %r", wanted, pools.gpu_limit_name())
        with pools.gpu_devices(wanted) as devices:
            logger.info("generating on %s", ", ".join(map(str, devices)))
            index = gen.generate_images(weights, prompts, seeds, out_dir, devices=devices, **kwargs)
    seconds = time.monotonic() - first["start"]
    already_there = int(first["already_there"])
    made = index.num_rows - already_there
    return {
        "out_dir": str(out_dir),
        "index": str(out_dir / gen.INDEX),
        "num_images": index.num_rows,
        "num_made": made,
        "num_already_there": already_there,
        "seconds": round(seconds, 2),
        "images_per_s": round(made / seconds, 3) if made else None,
        "by_device": dict(Counter(d for d in index["device"].to_pylist() if d is not None)),
        "files": index["file"].to_pylist()[:SHEET_IMAGES],
    }


def _on_ray(prompts, weights, out_dir, seeds, num_devices, kwargs):
    from flows.execution.cluster import forwarded_env
    from tasks.generation.generate_ray import generate_images_on_ray
    from tasks.runtime.ray_connect import connection

    with connection(None, runtime_env={"env_vars": forwarded_env()}):
        return generate_images_on_ray(
            weights, prompts, seeds, out_dir, num_workers=num_devices, **kwargs
        )


@flow(name="generate", log_prints=True)
def generate(
    prompts_file: str,
    weights: str,
    out_dir: str,
    per_prompt: int = 4,
    seed: int = 0,
    num_steps: int = 100,
    guidance_scale: float = 7.5,
    negative_prompt: str | None = None,
    live: bool = False,
    batch_size: int = 8,
    num_devices: int | None = None,
    data_root: str | None = None,
):
    """`per_prompt` images of every prompt of `prompts_file` (one per line, # comments), seeds
    `seed` ... `seed + per_prompt - 1`, into `out_dir` with `index.parquet`.

    `weights`: a run folder, its final/ or a checkpoint folder, or a run name under
    `<root>/runs/`. DDIM `num_steps`, CFG `guidance_scale`, EMA weights unless `live`;
    `negative_prompt` defaults to the run's (what its sample grids used; empty unless set).
    `num_devices`: workers (default: every device of this node; on Ray, every GPU).
    Relative paths are under the data root.
    """
    logger = get_run_logger()
    root = shards.data_root(data_root)
    try:
        prompts, folder = preflight(_in_root(prompts_file, root), weights, root)
        if per_prompt < 1:
            raise gen.GenerateError(f"per_prompt must be at least 1, not {per_prompt}")
        summary = generate_task(
            prompts,
            folder,
            _in_root(out_dir, root),
            seeds=list(range(seed, seed + per_prompt)),
            settings=gen.Settings(
                num_steps=num_steps, guidance_scale=guidance_scale, negative_prompt=negative_prompt
            ),
            use_ema=not live,
            batch_size=batch_size,
            num_devices=num_devices,
        )
    except (gen.GenerateError, gen.GenerateFailed, WeightsNotFound) as e:
        logger.error(str(e))
        return Failed(message=str(e))
    create_markdown_artifact(
        summary_markdown(summary, folder, live),
        key=artifact_key("generate", Path(summary["out_dir"]).name, "summary"),
        description=f"generate {summary['out_dir']}: what was made, and a few of the images",
    )
    return summary


def summary_markdown(summary: dict, weights: Path, live: bool) -> str:
    rate = summary["images_per_s"]
    lines = [
        f"# generate {summary['out_dir']}",
        f"- {summary['num_images']} images: {summary['num_made']} made now, "
        f"{summary['num_already_there']} already there",
        f"- {summary['seconds']} s" + (f", {rate} images/s" if rate else ""),
        "- by device: "
        + (", ".join(f"{d} {n}" for d, n in sorted(summary["by_device"].items())) or "-"),
        f"- weights ({'live' if live else 'EMA'}): `{weights}`",
        f"- index: `{summary['index']}`",
    ]
    out = Path(summary["out_dir"])
    if files := summary["files"]:
        from PIL import Image

        thumbs = []
        for name in files:
            with Image.open(out / name) as image:
                thumbs.append(image.convert("RGB").resize((SHEET_SIDE, SHEET_SIDE)))
        buf = io.BytesIO()
        image_grid(thumbs).save(buf, format="JPEG", quality=85)
        uri = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
        lines += ["", f"![the first {len(files)} images]({uri})"]
    return "\n".join(lines)


if __name__ == "__main__":
    generate()
