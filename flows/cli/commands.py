"""`sdpipe`: the command line. Errors a user can fix end in one line on stderr, exit code 2.

Commands that run a flow check the catalog, source and phase first (no Prefect needed), so a
typo fails in a second rather than after a server starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from catalog import CatalogError, load_catalog
from flows import lineage
from flows.cli.local import prefect_api  # the data root's own server, or PREFECT_API_URL
from tasks.runtime.shards import data_root


def _user_errors() -> tuple[type[Exception], ...]:
    from flows.cli.demo import DemoFailed
    from flows.cli.local import LocalServerError
    from flows.curriculum import PhaseNotReady
    from flows.evaluate import USER_ERRORS as EVAL_ERRORS
    from sdtrain.checkpoint import CheckpointError
    from sdtrain.models import ModelLoadError
    from sdtrain.weights import WeightsNotFound
    from tasks.curation.score import ScoringWeightsError
    from tasks.phases.mix import MixError
    from tasks.sources.table import SourceError

    return (
        CatalogError,
        SourceError,
        PhaseNotReady,
        MixError,
        ModelLoadError,
        WeightsNotFound,
        CheckpointError,
        LocalServerError,
        DemoFailed,
        ScoringWeightsError,
        *EVAL_ERRORS,
    )


def cmd_catalog(args: argparse.Namespace) -> None:
    c = load_catalog()
    print(f"catalog {c.directory}: ok")
    for kind in ("sources", "profiles", "datasets", "phases", "models", "evals"):
        print(f"  {kind}: {', '.join(getattr(c, kind))}")


def cmd_build_latents(args: argparse.Namespace) -> int:
    import flows.cli.progress as progress
    from flows.build_latents import build_latents, preflight

    preflight(args.source, data_root(args.data_root))
    with (
        prefect_api(data_root(args.data_root)),
        progress.watch(data_root(args.data_root), sources=[args.source]),
    ):
        state = build_latents(
            source=args.source,
            data_root=args.data_root,
            hf_dataset=args.hf_dataset,
            workers=args.workers,
            cluster=args.cluster,
            return_state=True,
        )
    return _report(state)


def cmd_curriculum(args: argparse.Namespace) -> int:
    import flows.cli.progress as progress
    from flows.curriculum import curriculum, preflight

    _, phase, _ = preflight(args.phase, data_root(args.data_root))
    with (
        prefect_api(data_root(args.data_root)),
        progress.watch(data_root(args.data_root), phases=[phase.name]),
    ):
        state = curriculum(
            phase=args.phase, data_root=args.data_root, nodes=args.nodes, cluster=args.cluster,
            return_state=True,
        )  # fmt: skip
    return _report(state)


def cmd_plan(args: argparse.Namespace) -> None:
    import json

    from tasks.phases import plan

    catalog = load_catalog()
    report = plan.plan_phase(
        data_root(args.data_root), catalog, catalog.phase(args.phase), nodes=args.nodes,
        cluster=args.cluster, ranks_per_node=args.ranks,
    )  # fmt: skip
    print(json.dumps(report, indent=1) if args.json else plan.format_plan(report))


def _report(state) -> int:
    if state.is_completed():
        return 0
    print(f"sdpipe: error: {state.message}", file=sys.stderr)
    return 1


def _weights(args: argparse.Namespace) -> Path:
    if args.weights is not None:
        return args.weights
    return data_root(args.data_root) / "runs" / load_catalog().phase(args.phase).name


def cmd_sample(args: argparse.Namespace) -> None:
    import torch

    from sdtrain.sampling import generate, image_grid
    from sdtrain.weights import load_networks

    device = None if args.device is None else torch.device(args.device)
    networks = load_networks(_weights(args), use_ema=not args.live, device=device)
    images = generate(
        networks,
        args.prompts,
        negative_prompt=args.negative,
        num_steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images).save(args.out)
    print(f"{len(images)} image(s) from {'live' if args.live else 'EMA'} weights: {args.out}")


def cmd_export(args: argparse.Namespace) -> None:
    import torch

    from sdtrain.export import export_pipeline
    from sdtrain.weights import load_networks

    networks = load_networks(_weights(args), use_ema=not args.live, device=torch.device("cpu"))
    folder, single_file = export_pipeline(networks, args.out, half=args.half)
    print(f"diffusers folder: {folder}\nsingle file: {single_file}")


def cmd_generate(args: argparse.Namespace) -> int:
    """Run the generate flow here on a prompt file; bad input fails before any server starts."""
    from flows.generate import generate, preflight
    from tasks.generation.generate import GenerateError

    root = data_root(args.data_root)
    try:
        _, weights = preflight(args.prompts.absolute(), args.weights, root)
    except GenerateError as e:
        print(f"sdpipe: error: {e}", file=sys.stderr)
        return 2
    with prefect_api(root):
        state = generate(
            prompts_file=str(args.prompts.absolute()),
            weights=str(weights),
            out_dir=str(args.out.absolute()),
            per_prompt=args.per_prompt,
            seed=args.seed,
            num_steps=args.steps,
            guidance_scale=args.guidance,
            negative_prompt=args.negative,
            live=args.live,
            batch_size=args.batch_size,
            num_devices=args.devices,
            data_root=args.data_root,
            return_state=True,
        )
    if code := _report(state):
        return code
    s = state.result()
    print(
        f"{s['num_images']} images ({s['num_made']} made, {s['num_already_there']} already "
        f"there) in {s['out_dir']}; index: {s['index']}"
    )
    return 0


# ---- finetune (self-contained: catalog entries of catalog/finetunes.yaml) --------------------


def cmd_finetune(args: argparse.Namespace) -> int:
    """A fine-tune here; with --sweep, one flow run of deployment finetune/NAME per value."""
    from flows import finetune as flow
    from tasks.finetune.data import FinetuneError

    root = data_root(args.data_root)
    try:
        settings = dict(flow.parse_values(item) for item in args.set or [])
        settings = {k: v[0] if len(v) == 1 else v for k, v in settings.items()}
        if args.sweep:
            key, values = flow.parse_values(args.sweep)
            flow.sweep_settings(args.name, key, values, settings)  # before any server starts
            with prefect_api(root):
                runs = flow.submit_sweep(
                    args.name, key, values, settings, nodes=args.nodes, cluster=args.cluster
                )
        else:
            _, _, warnings = flow.preflight(args.name, settings, root)
            for warning in warnings:
                print(f"sdpipe: warning: {warning}", file=sys.stderr)
    except FinetuneError as e:
        print(f"sdpipe: error: {e}", file=sys.stderr)
        return 2
    if args.sweep:
        for run, value in zip(runs, values, strict=True):
            print(f"submitted {run.name} ({key}={value}): finetune/{args.name} run {run.id}")
        if not args.wait:
            return 0
        with prefect_api(root):
            ended = flow.wait_for(runs)
        for run in ended:
            print(f"{run.name}: {run.state.name}")
        return 0 if all(r.state.is_completed() for r in ended) else 1
    with prefect_api(root):
        state = flow.finetune(
            name=args.name, settings=settings, data_root=args.data_root, nodes=args.nodes,
            cluster=args.cluster, return_state=True,
        )  # fmt: skip
    if code := _report(state):
        return code
    s = state.result()
    print(
        f"{args.name}/{s['run_name']}: {s['steps']} steps, loss {s['first_loss']:.4f} -> "
        f"{s['last_loss']:.4f}; export {s['export']['folder']}"
    )
    return 0


def _add_finetune_parser(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a catalog entry (DreamBooth, inpainting, LoRA) here, or with --sweep "
        "submit one run of deployment finetune/NAME per value",
    )
    p.add_argument("name", help="an entry of catalog/finetunes.yaml")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a setting (repeatable)"
    )
    p.add_argument(
        "--sweep", metavar="KEY=V1,V2,...", help="e.g. lr=1e-5,2e-5,5e-5: one flow run per value"
    )
    p.add_argument("--wait", action="store_true", help="with --sweep: wait for the runs to end")
    _add_nodes_arguments(p)
    p.set_defaults(fn=cmd_finetune)


def _add_nodes_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=0, help="train on N Ray nodes (default: catalog's)")
    p.add_argument("--cluster", default="", help="the Ray cluster (default: $RAY_ADDRESS)")


# ---- sdpipe eval ------------------------------------------------------------------------------


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a phase here (the eval flow), or print two phases' evals side by side."""
    from tasks.evaluation import eval_report

    root = data_root(args.data_root)
    if args.compare:
        catalog = load_catalog()
        found = [(p, eval_report.read_summary(root, catalog.phase(p).name)) for p in args.compare]
        if missing := [p for p, s in found if s is None]:
            print(f"sdpipe: error: no eval of {', '.join(missing)} under {root / 'runs'} "
                  "(sdpipe eval --phase N makes one)", file=sys.stderr)  # fmt: skip
            return 2
        print(eval_report.format_compare(found[0][1], found[1][1]))
        return 0
    from flows.evaluate import evaluate_phase, preflight

    name = preflight(args.phase, root)
    with prefect_api(root):
        state = evaluate_phase(
            phase=name,
            data_root=args.data_root,
            reference_dir=str(args.reference.absolute()) if args.reference else None,
            checkpoints=args.checkpoints,
            num_devices=args.devices,
            return_state=True,
        )
    if code := _report(state):
        return code
    summary = state.result()
    previous = eval_report.read_summary(root, summary["previous"]) if summary["previous"] else None
    print(eval_report.format_table(summary, previous))
    print(f"images, scores, summary: {root / 'runs' / name / 'eval'}")
    return 0


def _add_eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained phase on its eval set (CLIP score, aesthetic, FID, "
        "memorisation, validation loss by band, per category), or compare two phases' evals",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--phase", help="phase-N, N, or demo: evaluate its final weights")
    what.add_argument(
        "--compare", nargs=2, metavar=("PHASE_A", "PHASE_B"), help="print two evals side by side"
    )
    p.add_argument("--reference", type=Path, help="also FID against this folder of images")
    p.add_argument(
        "--checkpoints",
        action="store_true",
        help="also every kept checkpoint; link the best by the eval set's select_by metric",
    )
    p.add_argument("--devices", type=int, help="workers (default: every device of this node)")
    p.set_defaults(fn=cmd_eval)


def _add_weights_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--phase", help="a trained phase under the data root (runs/<phase>/)")
    source.add_argument(
        "--weights", type=Path, help="a run folder, its final/ or a checkpoint folder"
    )
    p.add_argument("--live", action="store_true", help="the live weights instead of the EMA")


def cmd_summary(args: argparse.Namespace) -> None:
    from flows.build_latents import format_source_summary

    root = data_root(args.data_root)
    sources = args.sources or sorted(
        p.name for p in root.iterdir() if p.is_dir() and (p / "metadata").is_dir()
    )
    for source in sources:
        print(format_source_summary(root, source))


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from flows.cli.status import format_status, status

    root = data_root(args.data_root)
    report = status(root, args.sources or None)
    print(json.dumps(report, indent=1) if args.json else format_status(report))
    failed = any(s["failed"] for stages in report["sources"].values() for s in stages)
    return 1 if failed or any(p["train"] == "failed" for p in report["phases"].values()) else 0


def cmd_refetch(args: argparse.Namespace) -> int:
    """List a URL source's failed fetches; with --run, fetch them again (kept images stay)."""
    import re
    from collections import Counter

    from tasks.sources import fetch_images

    root = data_root(args.data_root)
    catalog = load_catalog()
    src = catalog.source(args.source)
    if src.kind not in ("url", "demo"):
        from tasks.sources.table import SourceError

        raise SourceError(f"source {src.name!r} is of kind {src.kind!r}: only URL sources refetch")
    failed = fetch_images.failed_samples(root, src.name)
    reasons = None if args.all else fetch_images.TRANSIENT
    if args.reasons:
        reasons = re.compile("|".join(re.escape(r) for r in args.reasons))
    counts = Counter(failed["status"].to_pylist())
    print(f"{src.name}: {failed.num_rows} failed fetches")
    for reason, n in sorted(counts.items()):
        retried = reasons is None or reasons.fullmatch(reason)
        print(f"  {reason:<16} {n:>8}  {'refetched' if retried else 'kept as failed'}")
    if args.list:
        failed.to_pandas().to_csv(args.list, index=False)
        print(f"listed in {args.list}")
    if not args.run:
        print("(--run fetches them again; finished images are kept)")
        return 0
    profile = catalog.profile(src.profile)
    changed = 0
    for shard in sorted(set(failed["shard"].to_pylist())):
        stats = fetch_images.refetch_shard(
            root,
            src.name,
            shard,
            image_size=src.resolution,
            min_side=profile.min_side,
            reasons=reasons,
            allow_private_hosts=src.allow_private_hosts,
            **fetch_images.fetch_limits(src.options),
        )
        if stats is not None:
            changed += 1
            print(f"  shard {shard}: {stats.extra['refetched']} refetched, {stats.num_out} ok")
    print(f"{changed} shard(s) changed; rerun build-latents {src.name} to redo their later stages")
    return 0


def cmd_demo(args: argparse.Namespace) -> None:
    import flows.cli.demo as demo

    demo.main()


def cmd_prune_latents(args: argparse.Namespace) -> None:
    """Kept latents of an old spec that no phase set links (tasks.latents.kept_latents)."""
    from tasks.latents import kept_latents

    report = kept_latents.prune(data_root(args.data_root), args.sources, delete=args.yes)
    if not report["files"]:
        print("nothing to prune: every kept latents file is linked by a phase set")
        return
    for path, size in report["files"]:
        print(f"{path}  {size / 1e6:.1f} MB")
    total = f"{len(report['files'])} files, {report['bytes'] / 1e9:.3f} GB"
    if report["deleted"]:
        print(f"deleted {total}")
    else:
        print(f"would delete {total} (a dry run: nothing deleted; run with --yes to delete)")


def cmd_remove(args: argparse.Namespace) -> int:
    from flows.remove import cmd_remove  # the removal's own messages and exit codes

    return cmd_remove(args)


def cmd_stop(args: argparse.Namespace) -> None:
    import flows.cli.local as local

    stopped = local.stop(data_root(args.data_root))
    print("stopped: " + ", ".join(stopped) if stopped else "nothing was running")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdpipe", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-root", type=Path, default=None, help="data root (default: $SDPIPE_DATA or ./data)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("catalog", help="validate the catalog and list its entries").set_defaults(
        fn=cmd_catalog
    )
    p = sub.add_parser("build-latents", help="run every data stage for one source, here")
    p.add_argument("source")
    p.add_argument(
        "--hf-dataset",
        action="store_true",
        help="also export the tokens as a datasets DatasetDict under <root>/<source>/hf/",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="the node's worker budget each stage's concurrency derives from "
        "(default: $SDPIPE_WORKERS, else the cores); score and encode use every device",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run every per-shard stage on the nodes of this Ray cluster (default: "
        "$RAY_ADDRESS, else this machine); --workers then applies to each node",
    )
    p.set_defaults(fn=cmd_build_latents)
    p = sub.add_parser("curriculum", help="build a phase's mix and train it, here")
    p.add_argument("phase", help="phase-N, N, or demo")
    _add_nodes_arguments(p)
    p.set_defaults(fn=cmd_curriculum)
    p = sub.add_parser(
        "plan",
        help="what a phase will train on before it trains: requested vs available per dataset, "
        "steps, disk, ETA (fails, as the phase would, where a dataset is short)",
    )
    p.add_argument("phase", help="phase-N, N, or demo")
    p.add_argument("--ranks", type=int, help="ranks per node (default: as the training counts)")
    _add_nodes_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("summary", help="samples per stage and drop reason, from the data root")
    p.add_argument("sources", nargs="*")
    p.set_defaults(fn=cmd_summary)
    p = sub.add_parser(
        "status",
        help="per source and phase: stages done / running / failed, from the data root alone "
        "(works with the Prefect server down); exit code 1 if anything failed",
    )
    p.add_argument("sources", nargs="*", help="only these sources (default: all, and phases)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser(
        "refetch",
        help="a URL source's failed fetches by reason; --run fetches them again "
        "(transient failures by default), keeping the images already fetched",
    )
    p.add_argument("source")
    p.add_argument("--run", action="store_true", help="fetch again (default: only list)")
    p.add_argument("--all", action="store_true", help="every failure, not only transient ones")
    p.add_argument("--reasons", nargs="+", help="only these reasons, e.g. http_404 timeout")
    p.add_argument("--list", type=Path, help="write the failed URLs to this CSV file")
    p.set_defaults(fn=cmd_refetch)
    p = sub.add_parser(
        "sample", help="images from trained weights: DDIM, EMA, CFG with a negative prompt"
    )
    p.add_argument("prompts", nargs="+")
    _add_weights_arguments(p)
    p.add_argument("--negative", default="", help="negative prompt (default: empty)")
    p.add_argument("--steps", type=int, default=100, help="DDIM steps (default: 100)")
    p.add_argument("--guidance", type=float, default=7.5, help="CFG scale (default: 7.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cuda, mps or cpu (default: the first available)")
    p.add_argument("--out", type=Path, default=Path("samples.png"), help="PNG grid to write")
    p.set_defaults(fn=cmd_sample)
    p = sub.add_parser(
        "export", help="trained weights -> a diffusers folder and one .safetensors file"
    )
    p.add_argument("out", type=Path, help="folder to write; the single file is <out>.safetensors")
    _add_weights_arguments(p)
    p.add_argument("--half", action="store_true", help="fp16 weights (default: fp32)")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser(
        "generate",
        help="prompts x seeds -> PNG files + index.parquet; one worker per device; resumable",
    )
    p.add_argument("prompts", type=Path, help="prompt file: one per line, # comments")
    p.add_argument(
        "--weights", required=True, help="a run name under <root>/runs/, or a weights folder"
    )
    p.add_argument("--per-prompt", type=int, default=4, help="images per prompt (default: 4)")
    p.add_argument("--out", type=Path, required=True, help="folder of the images and index")
    p.add_argument("--seed", type=int, default=0, help="first seed of each prompt (default: 0)")
    p.add_argument("--steps", type=int, default=100, help="DDIM steps (default: 100)")
    p.add_argument("--guidance", type=float, default=7.5, help="CFG scale (default: 7.5)")
    p.add_argument("--negative", help="negative prompt (default: the run's, empty unless set)")
    p.add_argument("--live", action="store_true", help="the live weights instead of the EMA")
    p.add_argument("--batch-size", type=int, default=8, help="images per forward pass")
    p.add_argument("--devices", type=int, help="workers (default: every device of this node)")
    p.set_defaults(fn=cmd_generate)
    _add_finetune_parser(sub)
    _add_eval_parser(sub)
    lineage.add_parser(sub)
    p = sub.add_parser(
        "remove",
        help="take samples back: every output of SOURCE rewritten without the listed rows (kept "
        "generations and the HF export too), phase sets re-linked, the list kept as a blocklist",
    )
    p.add_argument("source")
    p.add_argument("--list", type=Path, required=True, dest="list_file",
                   help="URLs, hashes, image sha256s or keys: parquet, or a line each")  # fmt: skip
    p.add_argument("--widen", action="store_true",
                   help="also the same picture elsewhere (sha256, or pHash near)")  # fmt: skip
    p.set_defaults(fn=cmd_remove)
    p = sub.add_parser(
        "prune-latents",
        help="latents of an old spec kept for phase sets that no longer link them: "
        "list them (default), or delete them with --yes",
    )
    p.add_argument("sources", nargs="*", help="only these sources (default: all)")
    p.add_argument("--yes", action="store_true", help="delete them (default: only list)")
    p.set_defaults(fn=cmd_prune_latents)
    sub.add_parser(
        "demo", help="the whole chain on the demo source through deployments"
    ).set_defaults(fn=cmd_demo)
    sub.add_parser(
        "stop", help="stop the local Prefect server and worker of the data root"
    ).set_defaults(fn=cmd_stop)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.data_root is not None:
        args.data_root = str(args.data_root.absolute())
    try:
        return args.fn(args) or 0
    except _user_errors() as e:
        print(f"sdpipe: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
