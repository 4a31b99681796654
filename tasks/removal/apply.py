"""`sdpipe remove`: plan a removal over every output of a source, then apply it step by step.

Compaction, not a mask: every file holding a removed row is rewritten without it (temporary
name, rename), kept generations (`latents/spec-*`, `tokens/kept*`) included and never kept
aside, so no byte of a removed sample stays in an output; files without one are not touched.
Eval summaries whose nearest-training-image pairs show a removed row lose those pairs, and the
record says what the flow publishes again (`republish`: galleries, eval reports).
The plan is taken before any file changes and kept beside the blocklist (`removals/<digest>.*`:
the removed rows' identifiers, the row positions of the positional arrays, the counts each
stats record ends with); each step is idempotent, so a kill at any moment and a rerun end where
one run does, and a list applied before changes nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import FilterProfile
from sdtrain.atomic import TMP_MARK, atomic_path, write_json_atomic
from tasks.curation.waterfall import Waterfall
from tasks.removal import counts, lists, phase_sets, reports, rewrite
from tasks.removal.lists import FOLDER, Wanted
from tasks.runtime.shards import generation, generation_path

SKIPPED = ("mirror", FOLDER, "hf")  # the demo's upstream, the removals' own, re-exported whole
WATERFALL = "waterfall.json"


def record_path(root: Path, source: str, digest: str) -> Path:
    return root / source / FOLDER / f"{digest[:16]}.json"


def _files(source_dir: Path):
    for dirpath, dirnames, filenames in os.walk(source_dir):
        rel = Path(dirpath).relative_to(source_dir)
        if rel.parts and rel.parts[0] in SKIPPED:
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and TMP_MARK not in name:
                yield Path(dirpath) / name


def _npy_step(d: Path, npy: Path, rows: np.ndarray, steps: list, positions: list) -> None:
    """A positional array's step (its rows `rows` go), where the array exists."""
    if npy.exists():
        rel = str(npy.relative_to(d))
        steps.append({"kind": "npy", "file": rel, "rows": len(np.load(npy, mmap_mode="r"))})
        positions.append((rel, rows))


def plan(
    root: Path,
    source: str,
    wanted: Wanted,
    profile: FilterProfile,
    *,
    scored: bool,
    widen: bool = False,
) -> dict:
    """What the removal will do, read before anything changes; its rows and positions are
    written beside the record (`<digest>.rows.parquet`, `<digest>.positions.parquet`)."""
    d = root / source
    radius = profile.phash_distance if widen else 0
    found = lists.resolve(d, wanted, widen=widen, radius=radius)
    keys = found["key"]
    steps: list[dict] = []  # in order: positional arrays, then files naming keys
    positions: list[tuple[str, np.ndarray]] = []
    keyed: list[dict] = []
    waterfalls: list[Path] = []
    for path in _files(d):
        rel = str(path.relative_to(d))
        if path.name.endswith(".keys.arrow"):
            table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            if not rewrite.hit(table["key"], keys).any():
                continue
            shard = path.name.split(".")[0]
            for bucket, rows in rewrite.removed_positions(table, keys).items():
                if bucket == "tokens":
                    continue
                npy = path.with_name(f"{shard}.{bucket}.npy" if bucket else f"{shard}.npy")
                _npy_step(d, npy, rows, steps, positions)
            live = path.parent == d / "latents"
            keyed.append({"kind": "keys", "file": rel, "live": live})
        elif path.suffix == ".parquet":
            names = pq.read_schema(path).names
            if "key" not in names:
                continue
            column = pq.read_table(path, columns=["key"])["key"]
            drop = rewrite.hit(column, keys)
            if not drop.any():
                continue
            if path.parent.name.startswith("tokens") or path.parent.parent.name == "tokens":
                positions.append((rel, np.flatnonzero(drop)))  # token rows, for phase sets
                _npy_step(d, path.with_suffix(".npy"), np.flatnonzero(drop), steps, positions)
            keyed.append({"kind": "parquet", "file": rel})
        elif path.suffix == ".tar":
            if rewrite.tar_holds(path, keys):
                keyed.append({"kind": "tar", "file": rel})
        elif path.name.endswith(WATERFALL):
            waterfalls.append(path)
    targets = counts.targets(root, source, keys, profile, scored=scored) if len(keys) else {}
    gone = set(keys.to_pylist())
    for path in waterfalls:  # one that shows a removed sample, or counts its stage's rows
        wf = Waterfall.read(path)
        shown = any(r["key"] in gone for v in wf.samples.values() for r in v)
        if shown or f"{path.parent.name}/all.stats.json" in targets and path.name == WATERFALL:
            keyed.append({"kind": "waterfall", "file": str(path.relative_to(d))})
    # Tokens before keys files: a live keys file is marked with its tokens file as rewritten;
    # waterfalls after the tars their galleries' thumbnails are read from.
    order = {"parquet": 0, "tar": 1, "keys": 2, "waterfall": 3}
    steps += sorted(keyed, key=lambda s: (order[s["kind"]], s["file"]))
    # Eval reports whose nearest-training-image pairs show a removed row (under <root>/runs/).
    steps += [{"kind": "eval", "report": r} for r in reports.showing(root, source, keys)]
    if (d / "hf").is_dir() and len(keys):
        steps.append({"kind": "hf"})
    kept_aside = [f for s in steps if ("spec-" in (f := s.get("file", "")) or "/kept" in f)]
    removals = d / FOLDER
    removals.mkdir(parents=True, exist_ok=True)
    stem = wanted.digest[:16]
    with atomic_path(removals / f"{stem}.rows.parquet") as tmp:
        pq.write_table(found, tmp)
    table = pa.table(
        {
            "file": pa.array([f for f, rows in positions for _ in rows], pa.string()),
            "row": pa.array(np.concatenate([r for _, r in positions] or [[]]), pa.int64()),
        }
    )
    with atomic_path(removals / f"{stem}.positions.parquet") as tmp:
        pq.write_table(table, tmp)
    return {
        "list_sha256": wanted.digest,
        "source": source,
        "planned": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "widen": widen,
        "num_entries": wanted.num_entries,
        "num_rows": found.num_rows,
        "steps": steps,
        "counts": targets,
        # The source's generation after it (tasks.runtime.shards): the flows' cached "done" of
        # its stages are not reused; set, not bumped, so a rerun sets the same number.
        "generation": generation(root, source) + (1 if steps else 0),
        "kept_generations": kept_aside,  # rewritten like the live files, never kept aside
        "status": "planned",
    }


def _positions(d: Path, stem: str) -> dict[str, np.ndarray]:
    table = pq.read_table(d / FOLDER / f"{stem}.positions.parquet")
    out: dict[str, list] = {}
    for f, r in zip(table["file"].to_pylist(), table["row"].to_pylist(), strict=True):
        out.setdefault(f, []).append(r)
    return {f: np.sort(np.asarray(r, np.int64)) for f, r in out.items()}


def apply(
    root: Path,
    source: str,
    record: dict,
    *,
    export_hf: Callable[[], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Carry out a planned removal (`plan`'s record, written first); every step idempotent."""
    d = root / source
    stem = record["list_sha256"][:16]
    path = record_path(root, source, record["list_sha256"])
    if not path.exists():
        write_json_atomic(path, record)
    found = pq.read_table(d / FOLDER / f"{stem}.rows.parquet")  # the plan's rows
    keys = found["key"].combine_chunks()
    positions = _positions(d, stem)
    rewritten: dict[str, int] = {}
    step = 0

    def done(what: str, n: int) -> None:
        nonlocal step
        if n:
            rewritten[what] = n
        step += 1
        if on_step is not None:
            on_step(step)

    for s in record["steps"]:
        kind, file = s["kind"], s.get("file", "")
        p = d / file
        if kind == "npy":
            done(file, rewrite.npy(p, positions[file], s["rows"]))
        elif kind == "parquet":
            done(file, rewrite.parquet(p, keys))
        elif kind == "tar":
            done(file, rewrite.tar(p, keys))
        elif kind == "keys":
            tokens = d / "tokens" / f"{p.name.split('.')[0]}.parquet" if s["live"] else None
            done(file, rewrite.keys_file(p, keys, tokens))
        elif kind == "waterfall":
            done(file, _waterfall(p, keys, record["counts"]))
        elif kind == "eval":
            done(s["report"], reports.rewrite_summary(root / s["report"], source, keys))
        elif kind == "hf" and export_hf is not None:
            export_hf()
            done("hf", 1)
    record["stats_rewritten"] = counts.write(root, source, record["counts"])
    if generation(root, source) < record["generation"]:
        with atomic_path(generation_path(root, source)) as tmp:
            tmp.write_text(str(record["generation"]))
    done("stats", 0)
    record["blocklist_rows"] = lists.add_to_blocklist(root, source, found)
    done("blocklist", 0)
    absolute = {os.path.realpath(d / f): rows for f, rows in positions.items()}
    relinked = {}
    for folder in phase_sets.linking(root, set(absolute)):
        relinked[folder.name] = phase_sets.relink(
            folder, source, keys, absolute, record["list_sha256"]
        )
        done(f"phases/{folder.name}", 0)
    record["phase_sets"] = sorted(relinked)
    record["rows_removed"] = _rows_removed(record["counts"])
    record["files_rewritten"] = sorted({s["file"] for s in record["steps"] if "file" in s})
    # What shows a removed image on the dashboard, for the flow to publish again without it.
    record["republish"] = {
        "galleries": [s["file"] for s in record["steps"] if s["kind"] == "waterfall"],
        "eval_reports": [s["report"] for s in record["steps"] if s["kind"] == "eval"],
    }
    record["not_rewritten"] = not_rewritten(root, record["phase_sets"])
    record["status"] = "done"
    record["done"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json_atomic(path, record)
    return record


def _rows_removed(targets: dict[str, dict]) -> dict[str, int]:
    """Rows removed per stage: its records' `removed` plus what left its output."""
    out: dict[str, int] = {}
    for rel, target in targets.items():
        stage = rel.split("/")[0]
        out[stage] = out.get(stage, 0) + target.get("removed_out", 0)
    return out


def _waterfall(path: Path, keys: pa.Array, targets: dict[str, dict]) -> int:
    """A waterfall record without the removed samples, its counts as its stage's record now
    reads; its gallery page and dashboard markdown written again (thumbnails from the rewritten
    tars)."""
    wf = Waterfall.read(path)
    gone = set(keys.to_pylist())
    shown = sum(len(v) for v in wf.samples.values())
    wf.samples = {r: [x for x in v if x["key"] not in gone] for r, v in wf.samples.items()}
    wf.samples = {r: v for r, v in wf.samples.items() if v}
    target = targets.get(f"{path.parent.name}/all.stats.json")
    if target is not None and path.name == WATERFALL:
        before = {s.rule: s.removed for s in wf.steps}
        wf.num_in = target["num_in"]
        remaining = wf.num_in
        for s in wf.steps:
            now = target["dropped"].get(s.rule, 0)
            s.alone = max(0, s.alone - (before[s.rule] - now))
            s.removed = now
            remaining -= now
            s.remaining = remaining
        wf.num_out = remaining
    gallery = path.with_name(path.name.replace("waterfall.json", "gallery.html"))
    wf.write(path, gallery)
    return shown - sum(len(v) for v in wf.samples.values())


def not_rewritten(root: Path, phases: list[str]) -> list[str]:
    """What a removal cannot rewrite, for the record: the runs of phases whose sets it re-linked
    (TensorBoard events and sample grids show what they trained on; logs name rows; the copies
    of their sets' rows under `lineage/` are what tells which rows their checkpoints saw)."""
    out = []
    for phase in phases:
        run = root / "runs" / phase
        if run.is_dir():
            for p in sorted(run.rglob("*")):
                if p.is_file() and (
                    "events.out.tfevents" in p.name
                    or p.suffix in (".png", ".log", ".jsonl")
                    or p.parent.name == "lineage"
                ):
                    out.append(str(p.relative_to(root)))
    return out


def remove(
    root: Path,
    source: str,
    wanted: Wanted,
    profile: FilterProfile,
    *,
    scored: bool,
    widen: bool = False,
    export_hf: Callable[[], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Plan (unless a killed run planned it) and apply a removal; a done one is returned as it
    is, nothing changed."""
    path = record_path(root, source, wanted.digest)
    if path.exists():
        record = json.loads(path.read_text())
        if record["status"] == "done":
            return {**record, "already_done": True}
    else:
        record = plan(root, source, wanted, profile, scored=scored, widen=widen)
    return apply(root, source, record, export_hf=export_hf, on_step=on_step)
