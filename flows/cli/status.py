"""`sdpipe status`: per source and phase, what is done, running and failed, from the disk alone.

It reads only the records the stages leave under the data root, so it answers with the Prefect
server down (or never started), from any machine that mounts the data root:

- a shard is *done* when `<stage>/NNNNN.stats.json` exists (written last, after its outputs);
- *failed* when `<stage>/NNNNN.failed.json` exists and no stats record does (`run_shard` writes
  it when the shard's work raises, and removes it when a later run succeeds);
- *running* when hidden temporaries `<stage>/.NNNNN.*.tmp-PID` or the shard's marker
  `<stage>/.NNNNN.unit.tmp-running` exist and neither record does: a shard in progress, or one
  whose process was killed (its next run removes them);
- *todo* (per-shard stages after filter) the shards the filter wrote that are none of these.

A phase's mix is done when `phases/<phase>/mix.json` exists; its training is done when
`runs/<phase>/summary.json` exists, failed when `runs/<phase>/failed.json` does (written by the
curriculum flow), and running (or interrupted) when `runs/<phase>/log.jsonl` has steps.

Each stage also lists which node did each done shard (from the records' `node`): on a
cluster's build, a line of shards per node; `--json` has the shards of each.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from flows.execution.names import DISPLAY
from sdtrain.atomic import TMP_MARK
from tasks.phases import lineage
from tasks.runtime.shards import read_stats, summarize

# Stage folders in DAG order, and their dashboard names (the optional HF export is not a
# stage of every build).
STAGES = {stage: name for stage, name in DISPLAY.items() if stage != "hf"}
# Stages with one unit per filtered shard: their "todo" count is known.
PER_SHARD = ("shards", "scores", "tokens", "latents")


def _shard_of(name: str) -> str:
    """`00001.stats.json` -> `00001`; `.00001.npy.tmp-77` -> `00001`."""
    return name.lstrip(".").split(".")[0]


def stage_status(root: Path, source: str, stage: str, expected: set[str] | None) -> dict:
    d = root / source / stage
    names = [p.name for p in d.iterdir()] if d.is_dir() else []
    done = {_shard_of(n) for n in names if n.endswith(".stats.json") and not n.startswith(".")}
    failed = {
        _shard_of(n) for n in names if n.endswith(".failed.json") and not n.startswith(".")
    } - done
    running = {_shard_of(n) for n in names if n.startswith(".") and TMP_MARK in n} - done - failed
    records = read_stats(root, source, stage)
    counts = summarize(records)
    out = {
        "stage": STAGES[stage],
        "done": len(done),
        "running": len(running),
        "failed": len(failed),
        "todo": None if expected is None else len(expected - done - running - failed),
        "num_in": counts["num_in"],
        "num_out": counts["num_out"],
        "dropped": counts["dropped"],
        # Which node did each done shard (`node` of its record; records of older sdpipe
        # versions have none): {node: [shards]}.
        "nodes": _by_node(records),
        "failures": {},
    }
    for shard in sorted(failed):
        try:
            record = json.loads((d / f"{shard}.failed.json").read_text())
            out["failures"][shard] = f"{record['error']}: {record['message']}"
        except (OSError, ValueError, KeyError):
            out["failures"][shard] = "(unreadable failure record)"
    return out


def _by_node(records) -> dict[str, list[str]]:
    nodes: dict[str, list[str]] = {}
    for r in records:
        if r.node:
            nodes.setdefault(r.node, []).append(r.shard)
    return dict(sorted(nodes.items()))


def source_status(root: Path, source: str) -> list[dict]:
    filtered = root / source / "filtered"
    expected = {p.stem for p in filtered.glob("[0-9]*.parquet")} if filtered.is_dir() else None
    return [
        stage_status(root, source, stage, expected if stage in PER_SHARD else None)
        for stage in STAGES
        if (root / source / stage).is_dir()
    ]


def phase_status(root: Path, phase: str) -> dict:
    mix_file = root / "phases" / phase / "mix.json"
    run = root / "runs" / phase
    out: dict = {"phase": phase, "mix": "todo", "train": "todo", "step": None, "detail": ""}
    if mix_file.exists():
        out["mix"] = "done"
        with contextlib.suppress(OSError, ValueError):
            out["num_samples"] = json.loads(mix_file.read_text()).get("num_samples")
    steps = []
    if (run / "log.jsonl").exists():
        for line in (run / "log.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if "step" in record:
                steps.append(int(record["step"]))
    out["step"] = max(steps) if steps else None
    if (run / "summary.json").exists():
        out["train"] = "done"
        with contextlib.suppress(OSError, ValueError):
            s = json.loads((run / "summary.json").read_text())
            out["step"] = s.get("steps", out["step"])
            out["detail"] = f"{s.get('steps')}/{s.get('total_steps')} steps"
    elif (run / "failed.json").exists():
        out["train"] = "failed"
        try:
            record = json.loads((run / "failed.json").read_text())
            out["detail"] = f"{record['error']}: {record['message']}"
        except (OSError, ValueError, KeyError):
            out["detail"] = "(unreadable failure record)"
    elif steps or (run / "checkpoints").is_dir():
        out["train"] = "running"
        out["detail"] = "running or interrupted (a rerun resumes from the latest checkpoint)"
    return out


def sources_in(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and any((p / s).is_dir() for s in STAGES)
    )


def phases_in(root: Path) -> list[str]:
    names = set()
    for parent in (root / "phases", root / "runs"):
        if parent.is_dir():
            names.update(p.name for p in parent.iterdir() if p.is_dir())
    return sorted(names)


def status(root: Path, sources: list[str] | None = None) -> dict:
    return {
        "root": str(root),
        "sources": {s: source_status(root, s) for s in (sources or sources_in(root))},
        "phases": {p: phase_status(root, p) for p in ([] if sources else phases_in(root))},
        # checkpoints that trained on rows a removal took out since (tasks.phases.lineage)
        "removed_since": [] if sources else lineage.removed_flags(root),
    }


def format_status(report: dict) -> str:
    lines = [f"data root {report['root']}"]
    if not report["sources"] and not report["phases"]:
        lines.append("  nothing yet: no stage records under this root")
    for source, stages in report["sources"].items():
        lines.append(f"source {source}")
        lines.append(
            f"  {'stage':<15}{'done':>6}{'running':>9}{'failed':>8}{'todo':>6}{'in':>10}{'out':>10}"
        )
        for s in stages:
            todo = "-" if s["todo"] is None else s["todo"]
            lines.append(
                f"  {s['stage']:<15}{s['done']:>6}{s['running']:>9}{s['failed']:>8}{todo:>6}"
                f"{s['num_in']:>10}{s['num_out']:>10}"
            )
            if len(s["nodes"]) > 1:  # one node: nothing to tell (`--json` lists it too)
                spread = ", ".join(f"{n} {len(shards)}" for n, shards in s["nodes"].items())
                lines.append(f"    shards by node: {spread}")
            for shard, error in s["failures"].items():
                lines.append(f"    failed {shard}: {error}")
    for phase, p in report["phases"].items():
        step = "" if p["step"] is None else f" step {p['step']}"
        detail = f" ({p['detail']})" if p["detail"] else ""
        samples = f" ({p['num_samples']} samples)" if p.get("num_samples") is not None else ""
        lines.append(f"phase {phase}: mix {p['mix']}{samples}, train {p['train']}{step}{detail}")
    for f in report.get("removed_since", []):
        lines.append(
            f"  removed since: {f['checkpoint']} trained on {f['num_rows']} removed rows "
            f"(phase {f['phase']}, first at step {f['first_step']})"
        )
    return "\n".join(lines)
