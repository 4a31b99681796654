"""`sdpipe lineage`: the rows a checkpoint trained on (text, JSON lines or parquet), or which
checkpoints of which phases trained on given URLs or keys; and the dashboard's artifact of the
checkpoints that trained on rows removed since (`tasks.phases.lineage`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tasks.phases import lineage
from tasks.removal import lists
from tasks.runtime.shards import data_root

FLAGS_ARTIFACT = "lineage-removed"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "lineage",
        help="the rows a checkpoint trained on; or, with --url/--key/--list, the checkpoints "
        "that trained on any of them and the step they first did",
    )
    p.add_argument(
        "checkpoint",
        nargs="?",
        type=Path,
        help="a checkpoint folder (checkpoints/step-NNNNNN or final/), or a run under "
        "<root>/runs/ (its final/)",
    )
    p.add_argument("--url", action="append", default=[], help="a URL (repeatable)")
    p.add_argument("--key", action="append", default=[], help="a sample key (repeatable)")
    p.add_argument(
        "--list",
        type=Path,
        help="URLs, the metadata's hashes, image sha256s or sample keys, as `sdpipe remove "
        "--list` takes them: parquet (columns among url, hash, sha256, key) or one per line",
    )
    p.add_argument("--json", action="store_true", help="JSON (a checkpoint's rows: JSON lines)")
    p.add_argument("--parquet", type=Path, help="write the checkpoint's rows to this file")
    p.set_defaults(fn=cmd_lineage)


def _checkpoint(root: Path, given: Path) -> Path:
    """A folder as given, else under the data root, else a run's final/."""
    for candidate in (given, root / given, root / "runs" / given / "final"):
        if candidate.is_dir():
            return candidate
    return given


def cmd_lineage(args: argparse.Namespace) -> int:
    root = data_root(args.data_root)
    urls, keys = list(args.url), list(args.key)
    if args.list:
        try:  # the identifiers `sdpipe remove --list` takes, resolved the same way
            more_urls, more_keys = lists.resolve_root(root, lists.read_list(args.list))
        except lists.RemovalError as e:
            print(f"sdpipe: error: {e}", file=sys.stderr)
            return 2
        urls, keys = urls + more_urls.to_pylist(), keys + more_keys.to_pylist()
    try:
        if urls or keys:
            return _print_who_saw(lineage.who_saw(root, urls=urls, keys=keys), args.json)
        if args.checkpoint is None:
            raise lineage.LineageError("name a checkpoint, or --url, --key or --list")
        checkpoint = _checkpoint(root, args.checkpoint)
        if unrecorded := lineage.unrecorded_steps(checkpoint):
            print(
                f"sdpipe: warning: {checkpoint}: steps 1-{unrecorded} were trained before sdpipe "
                "recorded lineage; their rows are not listed",
                file=sys.stderr,
            )
        removed = lineage.removed_ids(root)
        if args.parquet:
            num_rows = lineage.write_lineage(checkpoint, args.parquet, removed)
            print(f"{num_rows} rows -> {args.parquet}")
            return 0
        for batch in lineage.lineage_batches(checkpoint, removed):
            for row in batch.to_pylist():  # printing: a line per row is what was asked for
                if args.json:
                    print(json.dumps(row))
                else:
                    gone = "\tREMOVED" if row["removed"] else ""
                    print(
                        f"{row['first_step']}\t{row['source']}\t{row['key']}\t{row['url']}\t"
                        f"{row['caption']}{gone}"
                    )
        return 0
    except (lineage.LineageError, FileNotFoundError) as e:
        print(f"sdpipe: error: {e}", file=sys.stderr)
        return 2


def _print_who_saw(found: list[dict], as_json: bool) -> int:
    if as_json:
        print(json.dumps(found, indent=1))
    elif not found:
        print("no checkpoint trained on any of them")
    for f in [] if as_json else found:
        print(
            f"phase {f['phase']}: {f['checkpoint']} (step {f['step']}) trained on "
            f"{f['num_rows']} of them, first at step {f['first_step']}"
        )
    return 0


def flags_markdown(flags: list[dict]) -> str:
    """The dashboard's list of checkpoints that trained on rows removed since."""
    if not flags:
        return "# lineage\nNo checkpoint trained on a row removed since."
    lines = ["# lineage: checkpoints that trained on rows removed since", ""]
    lines += [
        "| phase | checkpoint | step | removed rows | first at step |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {f['phase']} | `{f['checkpoint']}` | {f['step']} | {f['num_rows']} | "
        f"{f['first_step']} |"
        for f in flags
    ]
    return "\n".join(lines)


def publish_removed_flags(root: Path) -> list[dict]:
    """The flags (`lineage.removed_flags`) as the dashboard's `lineage-removed` artifact."""
    from prefect.artifacts import create_markdown_artifact

    flags = lineage.removed_flags(root)
    create_markdown_artifact(
        flags_markdown(flags),
        key=FLAGS_ARTIFACT,
        description="checkpoints that trained on rows removed since",
    )
    return flags
