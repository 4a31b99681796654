"""build-latents: every data stage for one source, one Prefect task run per shard.

fetch-metadata -> filter -> fetch-images -> [score] -> filter-pixels -> views -> tokenize ->
encode; score runs when the source's profile names a scorer. Global stages (filter,
filter-pixels) wait for every shard before them; per-shard stages run for the shards whose
inputs finished, so one bad shard costs only its own chain.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed
from prefect.task_runners import ThreadPoolTaskRunner

from catalog import Catalog, CatalogError, Source, load_catalog
from flows import pools
from flows.stages import DISPLAY, StageFailed, publish_waterfall, run_stage
from tasks import (
    adapters,
    demo_source,
    encode,
    fetch_images,
    filter,
    hf_export,
    metadata,
    score,
    shards,
    tokenize,
    views,
)
from tasks.metadata import SourceError
from tasks.score import ScoringWeightsError
from tasks.shards import read_stats, summarize

STAGES = ("metadata", "filtered", "shards", "scores", "selected", "tokens", "latents")


def preflight(source_name: str, root: Path) -> tuple[Catalog, Source]:
    """Everything checkable before any work, each failing in one line that says what to do: the
    catalog, the source and its location, the scoring weights its profile needs (before index
    and repack spend hours), and a build profile edited since its rows were selected."""
    catalog = load_catalog()
    source = catalog.source(source_name)
    metadata.check_source(source)
    profile = catalog.profile(source.profile)
    if profile.scorer:
        spec = catalog.scorer(profile.scorer)
        if not spec.random_weights:
            score.check_weights(spec)
    for stage in ("filtered", "selected"):
        filter.check_profile(root, source.name, stage, profile)
    return catalog, source


def source_summary(root: Path, source: str) -> dict[str, dict]:
    """Per stage: samples in / out and drops by reason, read from the stats records on disk.

    The score and (metadata) filter stages are listed only for sources that have them.
    """
    records = {stage: read_stats(root, source, stage) for stage in STAGES}
    optional = (score.STAGE, "filtered")  # unscored sources; archive sources filter on pixels
    return {
        stage: summarize(stats)
        for stage, stats in records.items()
        if stats or stage not in optional
    }


@flow(name="build-latents", task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def build_latents(source: str = "demo", data_root: str | None = None, hf_dataset: bool = False):
    """Fetch, filter, tokenize and encode one catalog source into `<root>/<source>/`.

    `hf_dataset`: also export the tokens as a Hugging Face `datasets` DatasetDict
    {train, validation} (seeded 1% split) under `<root>/<source>/hf/`."""
    logger = get_run_logger()
    root = shards.data_root(data_root)
    try:
        catalog, src = preflight(source, root)
        run_source(root, catalog, src, hf_dataset=hf_dataset)
    except (CatalogError, SourceError, ScoringWeightsError, StageFailed) as e:
        logger.error(str(e))
        return Failed(message=str(e))
    summary = source_summary(root, source)
    create_markdown_artifact(
        summary_markdown(source, summary),
        key=f"{source}-build-summary",
        description=f"build-latents {source}: samples per stage",
    )
    return summary


def run_source(root: Path, catalog: Catalog, src: Source, *, hf_dataset: bool = False) -> None:
    name = src.name
    profile = catalog.profile(src.profile)
    model = catalog.model(src.model)
    scored = bool(profile.scorer)
    failures: list[str] = []
    permanent: list[str] = []  # what a retry cannot fix, in the unit's own words

    def stage(
        stage_name: str, units: dict, *, needs_all: bool = False, inputs: dict | None = None
    ) -> dict[str, dict]:
        if needs_all and failures:
            raise StageFailed(
                f"{DISPLAY[stage_name]} needs every shard before it: "
                + _failed(failures, permanent)
            )
        done, failed = run_stage(root, name, stage_name, units, inputs)
        for s in sorted(failed):
            unit = f"{DISPLAY[stage_name]}-{name}-{s}"
            failures.append(unit)
            if failed[s].startswith("cannot succeed on a retry"):
                permanent.append(f"{unit} {failed[s]}")
        return done

    if src.kind in ("archive", "folder"):
        shard_names, fetched = archive_stages(root, src, profile, stage)
    else:
        shard_names, fetched = url_stages(root, src, profile, stage)
    if scored:
        spec = catalog.scorer(profile.scorer)
        stage(
            "scores",
            {s: functools.partial(score.score_shard, root, name, s, spec) for s in fetched},
        )
    stage(
        "selected",
        {filter.ALL: functools.partial(select_pixels, root, name, profile, scored=scored)},
        needs_all=True,
        inputs={filter.ALL: filter.profile_fingerprint(profile)},
    )
    selected_dir = root / name / "selected"
    publish_waterfall(name, selected_dir / "waterfall.json", selected_dir / "gallery.html")
    datasets = sorted(d.name for d in catalog.datasets.values() if d.source == name)
    stage(
        "views",
        {d: functools.partial(views.build_view, root, catalog, d) for d in datasets},
        inputs={d: views.fingerprint(root, catalog, d) for d in datasets},
    )
    for d in datasets:
        paths = views.view_paths(root, name, d)
        publish_waterfall(name, paths["waterfall"], paths["gallery"])
    tokenized = stage(
        "tokens",
        {s: functools.partial(tokenize.tokenize_shard, root, name, s) for s in shard_names},
    )
    if hf_dataset:
        stage(
            "hf",
            {"all": functools.partial(hf_export.export_hf_dataset, root, name)},
            needs_all=True,
        )
    stage(
        "latents",
        {
            s: functools.partial(encode.encode_shard, root, name, s, model)
            for s in shard_names
            if s in tokenized
        },
    )
    if failures:
        raise StageFailed(_failed(failures, permanent))


def select_pixels(root: Path, name: str, profile, *, scored: bool):
    """filter-pixels; semantic dedup computes on a device of the node's GPU pool (CPU without
    GPUs), holding its slot, so it never shares a GPU with score, encode or a training."""
    if "semantic" not in profile.dedup:
        return filter.select_pixels(root, name, profile, scored=scored)
    with pools.gpu_device() as device:
        on = str(device) if device.type == "cuda" else None
        return filter.select_pixels(root, name, profile, scored=scored, device=on)


def url_stages(root: Path, src: Source, profile, stage) -> tuple[list[str], dict]:
    """fetch-metadata -> filter (metadata rules, before any image) -> fetch-images."""
    name = src.name
    files = metadata.list_metadata_files(root, src)
    stage(
        "metadata",
        {
            f"{i:05d}": functools.partial(metadata.fetch_metadata_shard, root, src, i, f)
            for i, f in enumerate(files)
        },
    )
    stage(
        "filtered",
        {
            filter.ALL: functools.partial(
                filter.filter_metadata, root, name, profile, src.samples_per_shard
            )
        },
        needs_all=True,
        inputs={filter.ALL: filter.profile_fingerprint(profile)},
    )
    filtered_dir = root / name / "filtered"
    publish_waterfall(name, filtered_dir / "waterfall.json", filtered_dir / "gallery.html")
    shard_names = sorted(p.stem for p in filtered_dir.glob("[0-9]*.parquet"))
    server = (
        demo_source.serve_mirror(root / name / "mirror")
        if src.kind == "demo"
        else contextlib.nullcontext()
    )
    with server:
        fetched = stage(
            "shards",
            {
                s: functools.partial(
                    fetch_images.fetch_images_shard,
                    root,
                    name,
                    s,
                    image_size=src.resolution,
                    min_side=profile.min_side,
                )
                for s in shard_names
            },
        )
    return shard_names, fetched


def archive_stages(root: Path, src: Source, profile, stage) -> tuple[list[str], dict]:
    """index (the adapter's listing -> sample-table shards) -> repack (archives -> JPEG shards)."""
    adapter = adapters.adapter_for(src, profile)
    stage(
        "metadata",
        {adapters.ALL: functools.partial(adapters.index_source, root, src, adapter)},
        needs_all=True,
    )
    shard_names = adapters.shard_names(root, src.name)
    fetched = stage(
        "shards",
        {s: functools.partial(adapters.repack_shard, root, src, adapter, s) for s in shard_names},
    )
    return shard_names, fetched


def _failed(failures: list[str], permanent: list[str]) -> str:
    """The flow's one-line failure: what a retry cannot fix first, in its own words."""
    shown = ", ".join(failures[:10]) + (
        f" and {len(failures) - 10} more" if len(failures) > 10 else ""
    )
    if permanent:
        return (
            f"{permanent[0]} ({len(failures)} shard task(s) failed: {shown}; the rest are done "
            "and cached)"
        )
    return (
        f"{len(failures)} shard task(s) failed ({shown}); the rest are done "
        "and cached: retry the flow run to rerun only these"
    )


def summary_markdown(source: str, summary: dict[str, dict]) -> str:
    lines = [f"# build-latents {source}", "", "| stage | in | out | dropped |", "|---|---|---|---|"]
    for stage, s in summary.items():
        dropped = ", ".join(f"{r}: {n}" for r, n in s["dropped"].items()) or "-"
        lines.append(f"| {DISPLAY[stage]} | {s['num_in']} | {s['num_out']} | {dropped} |")
    return "\n".join(lines)


if __name__ == "__main__":
    build_latents()
