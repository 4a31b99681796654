"""remove/<source>: a takedown list applied to everything already built from a source.

The stage logic is tasks/removal (plan, then idempotent per-file steps; compaction, never a
mask); this flow checks the list before anything changes, runs it, publishes the filter
galleries and eval grids that showed a removed image again without it (their older artifact
versions deleted), a removal artifact (rows per stage, files rewritten, phase sets re-linked,
what could not be rewritten) and the lineage flags of the checkpoints that trained on removed
rows. `sdpipe remove` runs it here (`cmd_remove`: the command's work, its arguments parsed in
flows/cli/commands.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed

from catalog import CatalogError, load_catalog
from tasks.curation.waterfall import Waterfall
from tasks.evaluation.evaluate import CHOICE, SUMMARY, eval_dir
from tasks.latents import hf_export
from tasks.removal import apply, lists
from tasks.removal.lists import RemovalError
from tasks.runtime import pictures, shards
from tasks.runtime.shards import ShardStats, stats_path


def preflight(source: str, list_file: str | Path, root: Path) -> lists.Wanted:
    """The catalog source and the list, read before anything changes (one line each)."""
    catalog = load_catalog()
    catalog.source(source)
    if not (root / source).is_dir():
        raise RemovalError(f"source {source!r} has nothing built under {root / source}")
    wanted = lists.read_list(Path(list_file))
    if not wanted.num_entries:
        raise RemovalError(
            f"removal list {list_file}: no entries (one URL, hash, sha256 or key a line)"
        )
    return wanted


def run_removal(root: Path, source: str, list_file: str | Path, *, widen: bool = False) -> dict:
    """The removal, without Prefect: plan (or resume a killed one), apply, record."""
    wanted = preflight(source, list_file, root)
    catalog = load_catalog()
    profile = catalog.profile(catalog.source(source).profile)

    def export() -> None:  # the HF export again, with the split it was made with
        record = stats_path(root, source, hf_export.STAGE, "all")
        made = ShardStats.read(record).extra if record.exists() else {}
        hf_export.export_hf_dataset(
            root, source, val_fraction=made.get("val_fraction", 0.01), seed=made.get("seed", 0)
        )

    return apply.remove(
        root, source, wanted, profile, scored=bool(profile.scorer), widen=widen, export_hf=export
    )


def removal_markdown(record: dict) -> str:
    """The dashboard's removal artifact: identifiers and counts only, never images or captions."""
    md = pictures.md_text
    lines = [
        f"# removal {record['list_sha256'][:16]} of source {md(record['source'])}",
        f"List sha256 `{record['list_sha256']}`: {record['num_entries']} entries matched "
        f"{record['num_rows']} rows{' (widened to the same pictures)' if record['widen'] else ''}; "
        f"planned {record['planned']}, done {record.get('done', '-')}.",
        "",
        "| stage | rows removed from its output |",
        "|---|---|",
    ]
    lines += [f"| {md(stage)} | {n} |" for stage, n in sorted(record["rows_removed"].items())]
    lines += ["", f"{len(record['files_rewritten'])} files rewritten (temporary name, rename):"]
    lines += [f"- `{md(f)}`" for f in record["files_rewritten"][:200]]
    if record["phase_sets"]:
        lines += ["", "Phase sets re-linked without the rows: " + ", ".join(record["phase_sets"])]
    shown = [*record.get("republish", {}).get("galleries", [])]
    shown += record.get("republish", {}).get("eval_reports", [])
    if shown:
        lines += ["", "Published again without the removed images (older versions deleted):"]
        lines += [f"- `{md(f)}`" for f in shown]
    if record["not_rewritten"]:
        lines += ["", "Not rewritten (they show what runs trained on):"]
        lines += [f"- `{md(f)}`" for f in record["not_rewritten"][:200]]
    return "\n".join(lines) + "\n"


@flow(name="remove", log_prints=True)
def remove(
    source: str = "demo", list_file: str = "", widen: bool = False, data_root: str | None = None
):
    """Remove the samples `list_file` names (URLs, hashes, sha256s or keys; parquet or one a
    line) from every output of `source` under the data root; `widen`: also every sample with
    the same picture (sha256, or pHash within the profile's near-duplicate distance)."""
    from flows.lineage import publish_removed_flags

    logger = get_run_logger()
    root = shards.data_root(data_root)
    try:
        record = run_removal(root, source, list_file, widen=widen)
    except (CatalogError, RemovalError) as e:
        logger.error(str(e))
        return Failed(message=str(e))
    republished = republish(root, source, record)
    create_markdown_artifact(
        removal_markdown(record),
        key=f"{source}-removal-{record['list_sha256'][:16]}",
        description=f"remove {source}: rows removed per stage, files rewritten",
    )
    # The checkpoints that trained on rows removed now, flagged on the dashboard (and status).
    flagged = [f["checkpoint"] for f in publish_removed_flags(root)]
    kept = {k: v for k, v in record.items() if k not in ("steps", "counts")}
    return kept | {"flagged": flagged, "republished": republished}


def republish(root: Path, source: str, record: dict) -> list[str]:
    """The galleries and eval grids that showed a removed image (the record's `republish`), as
    new versions of their artifacts; the older versions, which embed it, are deleted from the
    server. Run again after a kill, it publishes the same. Returns the artifact keys."""
    from flows import evaluate
    from flows.execution import stages
    from tasks.evaluation import eval_report

    d, keys = root / source, []
    wanted = record.get("republish", {})
    for rel in wanted.get("galleries", []):
        report = d / rel
        gallery = report.with_name(report.name.replace("waterfall.json", "gallery.html"))
        stages.publish_waterfall(source, report, gallery)
        keys.append(stages.artifact_key(source, Waterfall.read(report).stage, "gallery"))
    for rel in wanted.get("eval_reports", []):
        summary_path = root / rel
        phase = summary_path.relative_to(root / "runs").parts[0]
        if summary_path != eval_dir(root, phase) / SUMMARY:
            continue  # a candidate checkpoint's: its pairs are published with the phase's
        summary = json.loads(summary_path.read_text())
        grid = eval_report.grid_markdown(root, summary)
        if (choice := eval_dir(root, phase) / CHOICE).is_file():
            grid += eval_report.choice_markdown(json.loads(choice.read_text()))
        keys.append(evaluate.artifact_key(phase, "grid"))
        create_markdown_artifact(
            grid, key=keys[-1], description=f"eval {phase}: published again after a removal"
        )
    delete_older_versions(keys)
    return keys


def delete_older_versions(keys: list[str]) -> None:
    """Every version of each artifact key but the newest."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    if not keys:
        return
    with get_client(sync_client=True) as client:
        for key in keys:
            versions = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                sort=ArtifactSort.CREATED_DESC,
            )
            for older in versions[1:]:
                client.delete_artifact(older.id)


def cmd_remove(args: argparse.Namespace) -> int:
    from flows.cli.local import prefect_api

    root = shards.data_root(args.data_root)
    try:
        preflight(args.source, args.list_file.absolute(), root)
    except RemovalError as e:
        print(f"sdpipe: error: {e}", file=sys.stderr)
        return 2
    with prefect_api(root):
        state = remove(
            source=args.source, list_file=str(args.list_file.absolute()), widen=args.widen,
            data_root=str(root), return_state=True,
        )  # fmt: skip
    if not state.is_completed():
        print(f"sdpipe: error: {state.message}", file=sys.stderr)
        return 1
    record = state.result()
    again = " (already done: nothing changed)" if record.get("already_done") else ""
    print(
        f"removal {record['list_sha256'][:16]}{again}: {record['num_rows']} rows of "
        f"{record['source']}; {len(record['files_rewritten'])} files rewritten; phase sets "
        f"re-linked: {', '.join(record['phase_sets']) or 'none'}; record in "
        f"{root / record['source'] / lists.FOLDER}"
    )
    if record["flagged"]:  # what trained on them: `sdpipe status`, `sdpipe lineage --list`
        print(f"checkpoints that trained on removed rows: {', '.join(record['flagged'])}")
    return 0
