"""mix: a phase's seeded sample of its datasets -> `phases/<phase>/` symlink set + manifest.

A dataset is a view: the encoded samples of its source whose keys its materialized view keeps
(`tasks.curation.views`: the filter's SQL over the source's selection). Each dataset is drawn from
its own seeded stream, so editing one entry does not reshuffle the others; a dataset holding less
than its share fails the phase unless the phase allows it (`allow_short`). The phase folder is
built under a hidden temporary name and swapped into place, so a reader never sees half a phase
set; while the phase's run has checkpoints, its phase set is kept as it is (a resume trains on
the rows it started on), or as a removal re-linked it without its rows: the run then resumes on
that set (the report's `remixed`, the trainer's `resume_remixed`: a new lineage segment).

Everything per sample is an Arrow or numpy column: the encoded keys are read from each shard's
keys file (`tasks.latents.latent_keys`), joined with the view one shard at a time, drawn by one
permutation per dataset, and written as the manifest plus the memory-mapped row index the
trainer's ranks share (`sdtrain.layout`).

A shard encoded in aspect buckets (docs/training-data.md, "Latents on disk") is a file of the
phase set per bucket: `<source>-<shard>.<WxH>`, its rows' latent row the keys file's
`bucket_row`, its drawn rows in the manifest by bucket (in the order of the shard's bucket
column's dictionary), each bucket's in keys order: a file's rows are one run of the index, read
front to back. The manifest then has a `bucket` column ("" on the rows of legacy shards, whose
file stays `<source>-<shard>`) and `files.json` each file's `bucket`, `views`, `channels`. All
shards of a dataset share one latent spec (else MixError naming them); datasets of one phase may
differ in views and channels (say, one source samples latents), which each file records.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from catalog import Catalog, Phase
from sdtrain import captions, fingerprints, layout
from sdtrain.atomic import TMP_MARK, clean_temporaries, replace_dir
from sdtrain.checkpoint import CheckpointDir, KeepPolicy
from tasks.phases.mix_read import EncodedView, MixError, dataset_view
from tasks.phases.mix_write import ManifestWriter, RowIndex, link_files
from tasks.removal import phase_sets

NO_PRUNING = KeepPolicy(checkpoint_every=0, keep_every=0)  # mix only reads the checkpoints


def draw_counts(phase: Phase, available: dict[str, int]) -> list[dict]:
    """Per mix entry: requested, available and taken samples, by the phase's rules.

    A count asks for that many; a ratio for its share of `phase.total`. A short dataset gives
    what it has, where the phase allows it (else MixError naming every short one); with ratios
    its shortfall goes to the other ratio entries in proportion to their ratios (as far as
    they hold more), so the phase keeps its total where the data allows.
    """
    report = []
    for entry in phase.mix:
        requested = entry.count if entry.count is not None else round(entry.ratio * phase.total)
        report.append(
            {
                "dataset": entry.dataset,
                "requested": requested,
                "available": available[entry.dataset],
                "taken": min(requested, available[entry.dataset]),
            }
        )
    short = [r for r in report if r["available"] < r["requested"]]
    allowed = phase.allow_short
    fraction = 0.0 if allowed is True else (1.0 if allowed is False else float(allowed))
    refused = [r for r in short if r["available"] < fraction * r["requested"]]
    if refused:
        listed = "; ".join(
            f"{r['dataset']}: requested {r['requested']}, available {r['available']}"
            for r in refused
        )
        allow = (
            "allow_short: true (or a fraction)"
            if allowed is False
            else f"allow_short below {allowed}"
        )
        raise MixError(
            f"phase {phase.name!r} is short of encoded samples ({listed}): build more of those "
            f"datasets (build-latents for their sources), lower their counts, or set {allow} "
            "on the phase to train on what there is"
        )
    ratio_rows = [(r, e.ratio) for r, e in zip(report, phase.mix, strict=True) if e.ratio]
    spare = sum(r["requested"] - r["taken"] for r, _ in ratio_rows)
    while spare > 0:  # hand the shortfall to the ratio entries with room left
        open_rows = [(r, w) for r, w in ratio_rows if r["taken"] < r["available"]]
        if not open_rows:
            break
        weight = sum(w for _, w in open_rows)
        given = 0
        for r, w in open_rows:
            extra = min(r["available"] - r["taken"], max(1, round(spare * w / weight)))
            extra = min(extra, spare - given)
            r["taken"] += extra
            given += extra
        spare -= given
        if given == 0:
            break
    for r in report:
        r["short"] = r["available"] < r["requested"]
    return report


def dataset_stream(phase: Phase, dataset: str) -> np.random.Generator:
    """The seeded stream a phase draws one dataset from (independent of the other entries)."""
    return np.random.default_rng([phase.seed, zlib.crc32(dataset.encode())])


def run_has_checkpoints(root: Path, phase: str) -> bool:
    checkpoints = root / "runs" / phase / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.glob("step-*"))


def resume_checkpoint(root: Path, phase: str) -> Path | None:
    """The checkpoint the phase's run resumes from: `latest`, else its newest step folder."""
    checkpoints = CheckpointDir(root / "runs" / phase / "checkpoints", NO_PRUNING)
    steps = checkpoints.steps()
    return checkpoints.latest() or (checkpoints.step_dir(steps[-1]) if steps else None)


def phase_set_for_run(root: Path, catalog: Catalog, phase: Phase) -> dict:
    """The phase set the phase's run trains on: the existing one while the run has checkpoints
    (a resume must see the rows it started on) and its sources are as it was mixed from (else
    MixError naming the changed file), else a fresh `build_phase_set`. A set a removal re-linked
    since the checkpoint was written is resumed on: `remixed` names the removals (else [])."""
    existing = root / "phases" / phase.name
    if run_has_checkpoints(root, phase.name) and (existing / "manifest.parquet").is_file():
        checkpoint = resume_checkpoint(root, phase.name)
        if (refused := phase_sets.refusal(existing, phase.name, checkpoint)) is not None:
            raise MixError(refused)  # re-linked, and no resume can say what the run saw
        try:  # its sources still hold their rows where the set reads them
            fingerprints.check(existing)
        except fingerprints.StalePhaseSet as e:
            raise MixError(str(e)) from e
        report = json.loads((existing / "mix.json").read_text())
        if phase.train_time_captions and not (existing / captions.CAPTIONS).is_file():
            # The phase turned train-time captions on since: the same rows, their text added.
            captions.write_captions(existing, root=root)
        return {**report, "reused": True, "remixed": phase_sets.crossed(existing, checkpoint)}
    return {**build_phase_set(root, catalog, phase), "reused": False, "remixed": []}


def draw(phase: Phase, dataset: str, num_rows: int, taken: int) -> np.ndarray:
    """Which rows of a dataset's view the phase takes (a mask): the first `taken` of its seeded
    stream's permutation, kept in row order (a mask, not a sort: linear in the view)."""
    order = dataset_stream(phase, dataset).permutation(num_rows)
    chosen = np.zeros(num_rows, bool)
    chosen[order[:taken]] = True
    return chosen


def build_phase_set(root: Path, catalog: Catalog, phase: Phase) -> dict:
    """Draw each dataset's share (seeded), write manifest + row index + symlinks; returns the
    mix report. The manifest is written in a thread while the next rows are drawn."""
    viewed = {e.dataset: dataset_view(root, catalog, e.dataset) for e in phase.mix}
    report = draw_counts(phase, {d: v.num_rows for d, v in viewed.items()})
    total = sum(r["taken"] for r in report)
    if total == 0:
        names = ", ".join(e.dataset for e in phase.mix)
        raise MixError(
            f"phase {phase.name!r}: no encoded samples in its datasets ({names}); "
            "run build-latents for their sources first"
        )
    phases_dir = root / "phases"
    phases_dir.mkdir(parents=True, exist_ok=True)
    clean_temporaries(phases_dir, f"{phase.name}.")
    final = phases_dir / phase.name
    tmp = phases_dir / f".{phase.name}{TMP_MARK}{os.getpid()}"
    (tmp / "latents").mkdir(parents=True)
    (tmp / "tokens").mkdir()
    index = RowIndex(total)
    # A set with any shard in buckets has a bucket column and per-file bucket, views, channels;
    # one of legacy shards only is written exactly as before.
    buckets = any(isinstance(v, EncodedView) and v.bucketed for v in viewed.values())
    with ManifestWriter(tmp / layout.MANIFEST) as manifest:
        for r in report:
            view = viewed.pop(r["dataset"])
            mask = draw(phase, r["dataset"], view.num_rows, r["taken"])
            if isinstance(view, EncodedView):
                batches = view.drawn(mask, buckets)
            else:  # a plain table (tests plant views as tables)
                batches = [(view.filter(mask), None)]
            for table, pieces in batches:
                manifest.write(table)
                index.add(table, pieces)
                # (train-time captions: `captions.arrow`, row i = manifest row i, is written
                # beside the manifest from these same tables, here.)
            del view, mask, batches
        files, rows = index.result()
        layout.write_rows(tmp, rows)
        link_files(root, tmp, files)
    fields = [f.fields() for f in files] if buckets else None
    names = [f.name for f in files]
    # Digests of the keys and tokens files each shard's rows point into (sdtrain.fingerprints).
    layout.write_files(tmp, names, rows, fields, fingerprints.record(tmp, names))
    if phase.train_time_captions:  # the text the loader tokenizes (sdtrain.captions)
        captions.write_captions(tmp, (names, rows), root)
    summary = {
        "phase": phase.name,
        "seed": phase.seed,
        "num_samples": total,
        "allow_short": phase.allow_short,
        "datasets": report,
    }
    if buckets:  # rows per bucket, before the trainer's validation hold-out
        index_files = [{"name": f.name, **f.fields()} for f in files]
        summary["buckets"] = layout.bucket_counts((index_files, rows))
    (tmp / "mix.json").write_text(json.dumps(summary, indent=1))
    replace_dir(tmp, final)
    return summary
