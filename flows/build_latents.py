"""build-latents: every data stage for one source, one Prefect task run per shard.

fetch-metadata -> filter -> fetch-images -> [score] -> filter-pixels -> views -> tokenize ->
encode; score runs when the source's profile names a scorer. Global stages (filter,
filter-pixels) wait for every shard before them; per-shard stages run for the shards whose
inputs finished, so one bad shard costs only its own chain.

The node sets the pace (`workers`: the node's worker budget, default the cores; the flow
builds its `Node` once, tasks/runtime/node.py, and passes it to every stage function, whose
process pools live within it), each stage with its own bound: fetch `concurrency.fetch_shards`,
repack `concurrency.pooled_shards` (into the shared decode pool), tokenize `workers` shards
(in processes above 2), score and encode one long-lived worker per device of the GPU pool
(flows/execution/devices.py). Per-shard stages overlap where no global step sits between them: a
shard is scored as soon as it is fetched, encoded as soon as it is tokenized.
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
from flows.execution import partitioned, pools
from flows.execution.cluster import ClusterError
from flows.execution.devices import read_ahead, warm_file
from flows.execution.executor import Executor, LocalExecutor, executor
from flows.execution.stages import DISPLAY, Stage, StageFailed, StageRun, publish_waterfall
from sdtrain.lazy import BUILD_LOCK
from tasks.curation import filter, filter_pixels, prefetch, score, selection, views
from tasks.curation.score import ScoringWeightsError
from tasks.latents import encode, hf_export, images, tokenize
from tasks.runtime import concurrency, shards
from tasks.runtime.node import Node
from tasks.runtime.shards import read_stats, summarize
from tasks.sources import adapters, demo_source, fetch_images, metadata
from tasks.sources.table import SourceError

STAGES = ("metadata", "filtered", "prefetch", "shards", "scores", "selected", "tokens", "latents")
# Each stage bounds its own task runs (StageRun): the flow's pool only has to have a thread
# for each, so its size is no limit (threads start on demand).
TASK_THREADS = 1024
# Shard task runs of a GPU stage at once, per device: they wait on the device's worker, and
# enough of them keep its pipeline fed (one shard encoding, the next ones being read).
SHARDS_PER_DEVICE = 4


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
    # Unscored sources; archive sources filter on pixels; prefetch only where a profile asks.
    optional = (score.STAGE, "filtered", prefetch.STAGE)
    return {
        stage: summarize(stats)
        for stage, stats in records.items()
        if stats or stage not in optional
    }


def format_source_summary(root: Path, source: str) -> str:
    """`sdpipe summary`'s lines of one source: a stage a line, its drops by reason."""
    lines = [f"{source}:"]
    for stage, s in source_summary(root, source).items():
        reasons = ", ".join(f"{r}={n}" for r, n in s["dropped"].items()) or "-"
        lines.append(
            f"  {DISPLAY[stage]:<14} shards={s['num_shards']:<4} in={s['num_in']:<8} "
            f"out={s['num_out']:<8} dropped: {reasons}"
        )
    return "\n".join(lines)


@flow(
    name="build-latents",
    task_runner=ThreadPoolTaskRunner(max_workers=TASK_THREADS),
    log_prints=True,
)
def build_latents(
    source: str = "demo",
    data_root: str | None = None,
    hf_dataset: bool = False,
    workers: int | None = None,
    cluster: str | None = None,
):
    """Fetch, filter, tokenize and encode one catalog source into `<root>/<source>/`.

    `hf_dataset`: also export the tokens as a Hugging Face `datasets` DatasetDict
    {train, validation} (seeded 1% split) under `<root>/<source>/hf/`, exported again when
    its token shards change.
    `workers`: the node's worker budget (default `SDPIPE_WORKERS`, else the cores); each
    stage's concurrency derives from it, score and encode from the node's devices.
    `cluster`: a Ray cluster's address (default `RAY_ADDRESS`; none: this node): every
    per-shard stage then runs on its nodes (flows/execution/cluster.py), `workers` each (default:
    the node's CPUs)."""
    logger = get_run_logger()
    root = shards.data_root(data_root)
    try:
        concurrency.workers(workers)
        partitioned.mode()
    except ValueError as e:  # workers=0, SDPIPE_WORKERS=abc: the message says what it expects
        logger.error(str(e))
        return Failed(message=str(e))
    try:
        catalog, src = preflight(source, root)
        with executor(cluster, workers) as nodes:
            run_source(root, catalog, src, nodes, hf_dataset=hf_dataset)
    except (CatalogError, SourceError, ScoringWeightsError, StageFailed, ClusterError) as e:
        logger.error(str(e))
        return Failed(message=str(e))
    summary = source_summary(root, source)
    create_markdown_artifact(
        summary_markdown(source, summary),
        key=f"{source}-build-summary",
        description=f"build-latents {source}: samples per stage",
    )
    return summary


def stage_limits(budget: int, devices: int, *, archive: bool = False) -> dict[str, int]:
    """Shard task runs at once per stage, from the node's worker budget and its devices.

    Downloads (fetch-metadata, fetch-images): `concurrency.fetch_shards` (each fetch shard runs
    its own processes and threads); repack: `concurrency.pooled_shards` (readers feeding the
    shared decode processes); views and tokenize: the budget (tokenize in that many processes
    above 2); score and encode: `SHARDS_PER_DEVICE` per device, waiting on its one worker. A
    2-core machine without GPUs: 2 at a time, as before; score and encode one shard at a time
    on `cpu:0` (the GPU pool's one slot), as before."""
    fetch = concurrency.fetch_shards(budget)
    return {
        "metadata": fetch,
        "shards": concurrency.pooled_shards(budget) if archive else fetch,
        "scores": SHARDS_PER_DEVICE * devices,
        "views": budget,
        "tokens": budget,
        "latents": SHARDS_PER_DEVICE * devices,
    }


def node_limits(budget: int, devices: int, *, archive: bool = False) -> dict[str, int]:
    """A node's limits: its stages' (`stage_limits`) and its partition task runs at once
    (flows/execution/partitioned.py: one per worker of the budget, each in a process of the
    node's call pool)."""
    return stage_limits(budget, devices, archive=archive) | {"partitions": budget}


class _Run:
    """The stages of one source's build: what failed so far, and the barriers it blocks."""

    def __init__(self, root: Path, src: Source, nodes: Executor):
        self.root, self.name, self.nodes = root, src.name, nodes
        # Each node's limits (on a cluster summed: every node at its one-node pace).
        archive = src.kind in ("archive", "folder")
        self.limits = nodes.limits(functools.partial(node_limits, archive=archive))
        self.on_cluster = not isinstance(nodes, LocalExecutor)  # partitioned stages' `auto`
        self.stages = StageRun(root, src.name)
        self.failures: list[str] = []
        self.permanent: list[str] = []  # what a retry cannot fix, in the unit's own words
        self.scorer_identity: dict | None = None  # the score stage's (`score.scorer_identity`)

    def remote(self, stage_name: str, unit, shard: str):
        """A per-shard unit of a CPU stage (`unit(node)`), run on a node of the executor's."""
        return self.nodes.unit(stage_name, unit, shard)

    def devices(self, stage_name: str, name: str, serve, release):
        """A GPU stage's workers (`serve(node, device, shards)`): one per device of each of the
        executor's nodes."""
        return self.nodes.devices(stage_name, name, serve, release)

    def stage(
        self,
        stage_name: str,
        *,
        limit: int | None,
        needs_all: bool = False,
        inputs: dict | None = None,
        expected: int = 0,
        done=None,
        name: str | None = None,
    ) -> Stage:
        if needs_all and self.failures:
            raise StageFailed(
                f"{name or DISPLAY[stage_name]} needs every shard before it: "
                + self.failed_message()
            )
        one = self.stages.stage(
            stage_name, limit=limit, inputs=inputs, expected=expected, done=done, name=name
        )
        one.on_end(self._record)
        return one

    def failed_message(self) -> str:
        return _failed(self.failures, self.permanent)

    def _record(self, one: Stage) -> None:
        for s in sorted(one.failed):
            unit = f"{one.name}-{self.name}-{s}"
            self.failures.append(unit)
            if one.failed[s].startswith("cannot succeed on a retry"):
                self.permanent.append(f"{unit} {one.failed[s]}")

    def run(
        self,
        stage_name: str,
        units: dict,
        *,
        limit: int | None = None,
        needs_all: bool = False,
        inputs: dict | None = None,
        done=None,
    ) -> dict[str, dict]:
        """One stage on its own: every unit, then return the finished ones' stats."""
        one = self.stage(stage_name, limit=limit, needs_all=needs_all, inputs=inputs, done=done)
        for unit, fn in units.items():
            one.add(unit, fn)
        one.seal()
        self.stages.wait()
        return one.done


def run_source(
    root: Path,
    catalog: Catalog,
    src: Source,
    nodes: Executor,
    *,
    hf_dataset: bool = False,
) -> None:
    """Every stage of `src` on the executor's nodes (`flows.execution.executor`: this node, or a Ray
    cluster's)."""
    name = src.name
    profile = catalog.profile(src.profile)
    model = catalog.model(src.model)
    run = _Run(root, src, nodes)
    get_run_logger().info("build-latents %s on %s", name, nodes.describe())
    scored, scorer = bool(profile.scorer), None
    if scored:
        spec = catalog.scorer(profile.scorer)
        run.scorer_identity = score.scorer_identity(spec)  # its weights hashed once here
        scorer = run.devices(
            score.STAGE,
            f"score-{name}",
            functools.partial(_serve_scores, root, name, spec),
            _release_scorer,
        )
    with scorer or contextlib.nullcontext():
        if src.kind in ("archive", "folder"):
            shard_names = archive_stages(run, src, profile, scorer)
        else:
            shard_names = url_stages(run, src, profile, scorer)
    # The selection is chosen from the scores of this scorer: a re-score selects again.
    identity = run.scorer_identity
    chosen_by = f"-{score.identity_digest(identity)}" if identity else ""
    select = functools.partial(select_pixels, root, name, profile, identity)
    needs_parts = partitioned.pixels_need_parts(root, name, profile)
    if partitioned.use_partitioned(run.on_cluster, needs_parts):
        partitioned.select_pixels(run, identity, select)
    else:
        run.run(
            "selected",
            {filter.ALL: select},
            needs_all=True,
            inputs={filter.ALL: filter.profile_fingerprint(profile) + chosen_by},
            done=lambda _: selection.selection_done(root, name, identity),
        )
    selected_dir = root / name / "selected"
    publish_waterfall(name, selected_dir / "waterfall.json", selected_dir / "gallery.html")

    # views, tokenize and encode at once: a shard is encoded as soon as it is tokenized.
    datasets = sorted(d.name for d in catalog.datasets.values() if d.source == name)
    view_stage = run.stage(
        "views",
        limit=run.limits["views"],
        inputs={d: views.fingerprint(root, catalog, d) for d in datasets},
    )
    for d in datasets:
        view_stage.add(d, functools.partial(views.build_view, root, catalog, d))
    view_stage.seal()
    # The latent layout (bucket plan, flips, log-variance) from the catalog: part of the
    # encode task's cache key, and a shard is done only under it.
    spec = encode.spec_for(catalog, name)
    encoders = run.devices(
        encode.STAGE,
        f"encode-{name}",
        functools.partial(_serve_latents, root, name, model, spec),
        encode.release_device,
    )
    with encoders:
        tokens = run.stage("tokens", limit=run.limits["tokens"], expected=len(shard_names))
        latents = run.stage(
            "latents",
            limit=run.limits["latents"],
            expected=len(shard_names),
            inputs=dict.fromkeys(shard_names, spec.digest()),
            done=functools.partial(encode.shard_done, root, name, spec=spec),
        )
        tokens.on_done(lambda s, _: latents.add(s, functools.partial(encoders.run, s)))
        tokens.on_end(lambda _: latents.seal())
        if hf_dataset:
            tokens.on_end(lambda _: _export_hf(run))
        for s in shard_names:
            tokens.add(s, run.remote("tokens", _tokenize_unit(root, name, s), s))
        tokens.seal()
        run.stages.wait()
    for d in datasets:
        paths = views.view_paths(root, name, d)
        publish_waterfall(name, paths["waterfall"], paths["gallery"])
    if run.failures:
        raise StageFailed(_failed(run.failures, run.permanent))


def _export_hf(run: _Run) -> None:
    """The Hugging Face export needs every shard's tokens: not run if a shard failed (the
    flow then fails naming it; a retry runs the export)."""
    if run.failures:
        get_run_logger().error("%s needs every shard before it: not run", DISPLAY["hf"])
        return
    # Keyed and checked by the token shards there now: a shard tokenized again (a re-selection)
    # or added is a cache miss and an export again, never the old export's "done".
    digest = hf_export.inputs_digest(hf_export.token_inputs(run.root, run.name))
    hf = run.stage(
        "hf",
        limit=1,
        inputs={shards.WHOLE_STAGE: digest},
        done=lambda _: hf_export.export_done(run.root, run.name),
    )
    hf.add(shards.WHOLE_STAGE, functools.partial(hf_export.export_hf_dataset, run.root, run.name))
    hf.seal()


def _tokenize_unit(root: Path, name: str, shard: str):
    """tokenize holds the GIL: its shards run in the node's processes where its budget
    allows, as many as the budget up to a cap (`concurrency.tokenize_processes`); the unit
    takes the node that runs it."""
    return functools.partial(_tokenize, root, name, shard)


def _tokenize(root: Path, name: str, shard: str, node: Node):
    if concurrency.use_processes(node.workers):
        processes = concurrency.tokenize_processes(node.workers)
        return node.in_process(processes, tokenize.tokenize_shard, root, name, shard)
    return tokenize.tokenize_shard(root, name, shard)


def without_node(fn):
    """The unit of work that needs nothing of the node (fetch-metadata)."""
    return functools.partial(_call_alone, fn)


def with_node(fn):
    """The unit of work that takes the node as its `node` keyword (fetch-images)."""
    return functools.partial(_call_with_node, fn)


def _call_alone(fn, node: Node):
    return fn()


def _call_with_node(fn, node: Node):
    return fn(node=node)


def _serve_scores(root: Path, name: str, spec, node: Node, device, shards):
    """A device's scorer: built once on it (`score.load_scorer`), over the shards it is dealt,
    the next shard's tar read while one is scored."""
    tars = root / name / "shards"
    for shard in read_ahead(shards, lambda s: warm_file(tars / f"{s}.tar")):
        try:
            stats = score.score_shard(root, name, shard, spec, device=str(device), node=node)
        except Exception as e:  # this shard's failure; the worker goes on with the next
            yield shard, e
        else:
            yield shard, stats


def _release_scorer(device) -> None:
    """Forget this process's scorers on `device` once its worker gives it back."""
    with BUILD_LOCK:
        cached = getattr(score, "_scorers", {})
        for key in [k for k in cached if k[1] == str(device)]:
            del cached[key]
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def _serve_latents(root: Path, name: str, model, spec, node: Node, device, shards):
    """A device's encoder: one pipeline over the shards it is dealt (`encode.encode_stream`),
    writing the source's latent layout `spec`.

    On GPUs the node's decode processes are shared by every device's pipeline: the budget but
    two cores per device (its I/O and feeding threads, the VAE's launches). On CPU the
    encoder's default (1)."""
    num_workers = None
    if device.type == "cuda":
        num_workers = max(1, node.workers - 2 * len(node.devices))
    yield from encode.encode_stream(
        root, name, shards, model, device=device, num_workers=num_workers, spec=spec, node=node
    )


def _fetch_then_score(run: _Run, units: dict, scorer) -> list[str]:
    """fetch-images (or repack) and score as one chain per shard: a shard is scored (on a
    device's scorer) as soon as it is fetched, while later shards still download."""
    fetch = run.stage("shards", limit=run.limits["shards"], expected=len(units))
    if scorer is not None:
        # A shard is done only as scored by this scorer (its weights' digests, settings).
        identity = run.scorer_identity
        scores = run.stage(
            score.STAGE,
            limit=run.limits["scores"],
            expected=len(units),
            inputs=dict.fromkeys(units, score.identity_digest(identity)),
            done=functools.partial(score.shard_done, run.root, run.name, identity=identity),
        )
        fetch.on_done(lambda s, _: scores.add(s, functools.partial(scorer.run, s)))
        fetch.on_end(lambda _: scores.seal())
    for s, fn in units.items():
        fetch.add(s, fn)
    fetch.seal()
    run.stages.wait()
    return list(units)


def select_pixels(root: Path, name: str, profile, identity: dict | None, phash=None, semantic=None):
    """filter-pixels (scored when the scorer's `identity` is given); semantic dedup computes on
    a device of the node's GPU pool (CPU without GPUs), holding its slot, so it never shares a
    GPU with score, encode or a training. `phash`, `semantic`: its pHash and semantic levels'
    losers (`flows.execution.partitioned.select_pixels`)."""
    options = dict(
        scored=identity is not None, scorer_identity=identity, phash=phash, semantic=semantic
    )
    if "semantic" not in profile.dedup:
        return filter_pixels.select_pixels(root, name, profile, **options)
    with pools.gpu_device() as device:
        on = str(device) if device.type == "cuda" else None
        return filter_pixels.select_pixels(root, name, profile, device=on, **options)


def url_stages(run: _Run, src: Source, profile, scorer) -> list[str]:
    """fetch-metadata -> filter (metadata rules, before any image) -> fetch-images [-> score]."""
    root, name = run.root, src.name
    files = metadata.list_metadata_files(root, src)
    run.run(
        "metadata",
        {
            f"{i:05d}": run.remote(
                "metadata",
                without_node(functools.partial(metadata.fetch_metadata_shard, root, src, i, f)),
                f"{i:05d}",
            )
            for i, f in enumerate(files)
        },
        limit=run.limits["metadata"],
    )
    if partitioned.use_partitioned(run.on_cluster, partitioned.filter_needs_parts(root, name)):
        partitioned.filter_metadata(run, profile, src.samples_per_shard)
    else:
        run.run(
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
    if before_fetch := prefetch.wanted(src, profile):  # duplicates found before any fetch
        _prefetch_dedup(run, src, profile)
    server = (
        demo_source.serve_mirror(root / name / "mirror")
        if src.kind == "demo"
        else contextlib.nullcontext()
    )
    units = {
        s: run.remote(
            "shards",
            with_node(
                functools.partial(
                    fetch_images.fetch_images_shard,
                    root,
                    name,
                    s,
                    image_size=src.resolution,
                    min_side=profile.min_side,
                    allow_private_hosts=src.allow_private_hosts,
                    dropped=prefetch.dropped_path(root, name, s) if before_fetch else None,
                    **fetch_images.fetch_limits(src.options),
                ),
            ),
            s,
        )
        for s in shard_names
    }
    with server:
        return _fetch_then_score(run, units, scorer)


def _prefetch_dedup(run: _Run, src: Source, profile) -> None:
    """Semantic dedup on the source's published embeddings, one unit after the metadata
    filter (tasks/curation/prefetch.py); fetch-images then skips its dropped keys."""
    fingerprint = filter.profile_fingerprint(profile) + str(src.options["embeddings"])
    run.run(
        prefetch.STAGE,
        {filter.ALL: functools.partial(prefetch.prefetch_dedup, run.root, src, profile)},
        needs_all=True,
        inputs={filter.ALL: fingerprint},
    )
    folder = run.root / src.name / prefetch.STAGE
    publish_waterfall(src.name, folder / "waterfall.json", folder / "gallery.html")


def archive_stages(run: _Run, src: Source, profile, scorer) -> list[str]:
    """index (the adapter's listing -> sample-table shards) -> repack (archives -> JPEG shards)
    [-> score]."""
    adapter = adapters.adapter_for(src, profile)
    run.run(
        "metadata",
        {adapters.ALL: functools.partial(adapters.index_source, run.root, src, adapter)},
        needs_all=True,
    )
    units = {
        s: run.remote("shards", functools.partial(_repack, run.root, src, adapter, s), s)
        for s in adapters.shard_names(run.root, src.name)
    }
    return _fetch_then_score(run, units, scorer)


def _repack(root: Path, src: Source, adapter, shard: str, node: Node):
    """repack into the node's decode workers: one process pool up to its budget, every
    shard's."""
    pool = images.shared_pool(node)
    return adapters.repack_shard(root, src, adapter, shard, pool=pool)


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
