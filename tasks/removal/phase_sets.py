"""Phase sets that link a source file a removal rewrote: re-linked without the removed rows.

A set reads rows of its linked files by position, and a removal compacts those files, so each
set that links one is written again (in a hidden folder, exchanged with the old in one rename):
its manifest without the removed rows, every later row renumbered as the compacted files hold
it, its index, captions and fingerprints made anew, and `removed.json` naming the removal. A run
with checkpoints of the old set resumes on the new one (`crossed`: the trainer's
`resume_remixed`, a lineage segment per set, so which rows it saw stays derivable); it is refused
(`refusal`) where that cannot hold: no row left, or a checkpoint without lineage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain import captions, fingerprints, layout
from sdtrain.atomic import TMP_MARK, clean_temporaries, replace_dir
from sdtrain.checkpoint import LINEAGE_FILE
from sdtrain.lineage import read_segments
from sdtrain.run_data import manifest_digest
from tasks.removal.rewrite import hit

NOTE = "removed.json"


def linking(root: Path, targets: set[str]) -> list[Path]:
    """The phase sets under `root` with a link to one of `targets` (real paths)."""
    out = []
    phases = root / "phases"
    for folder in sorted(phases.iterdir()) if phases.is_dir() else []:
        if folder.name.startswith(".") or not (folder / layout.MANIFEST).is_file():
            continue
        for kind in ("latents", "tokens"):
            links = folder / kind
            if links.is_dir() and any(
                os.path.realpath(e.path) in targets for e in os.scandir(links) if e.is_symlink()
            ):
                out.append(folder)
                break
    return out


def applied(folder: Path, digest: str) -> bool:
    note = folder / NOTE
    return note.exists() and digest in json.loads(note.read_text()).get("removals", [])


def relink(
    folder: Path, source: str, keys: pa.Array, positions: dict[str, np.ndarray], digest: str
) -> int:
    """Write the set `folder` again without the removed rows of `source` (`positions`: removed
    rows per real path of a rewritten latents or tokens file). Returns the rows taken out."""
    if applied(folder, digest):
        return 0
    meta = json.loads((folder / layout.FILES).read_text())
    manifest = pq.read_table(folder / layout.MANIFEST)
    names, rows = layout.index_of(manifest)
    drop = hit(manifest["key"], keys) & (
        np.asarray(manifest["source"].to_pylist(), dtype=object) == source
    )
    rows = rows.astype(np.int64)
    for f, name in enumerate(names):
        mine = rows[:, 0] == f
        latents = os.path.realpath(folder / "latents" / f"{name}.npy")
        tokens = os.path.realpath(folder / "tokens" / f"{name}.parquet")
        if (gone := positions.get(latents)) is not None:
            rows[mine, 1] -= np.searchsorted(gone, rows[mine, 1])
        if (gone := positions.get(tokens)) is not None:
            rows[mine, 2] -= np.searchsorted(gone, rows[mine, 2])
    keep = ~drop
    new_manifest = manifest.filter(pa.array(keep))
    new_manifest = new_manifest.set_column(
        new_manifest.schema.get_field_index("latent_row"),
        "latent_row",
        pa.array(rows[keep, 1], manifest.schema.field("latent_row").type),
    )
    new_manifest = new_manifest.set_column(
        new_manifest.schema.get_field_index("token_row"),
        "token_row",
        pa.array(rows[keep, 2], manifest.schema.field("token_row").type),
    )
    phases = folder.parent
    clean_temporaries(phases, f"{folder.name}.")
    tmp = phases / f".{folder.name}{TMP_MARK}{os.getpid()}"
    (tmp / "latents").mkdir(parents=True)
    (tmp / "tokens").mkdir()
    pq.write_table(new_manifest, tmp / layout.MANIFEST)
    new_names, new_rows = layout.index_of(new_manifest)
    for kind in ("latents", "tokens"):
        for entry in os.scandir(folder / kind):
            if entry.is_symlink() and entry.name.rsplit(".", 1)[0] in new_names:
                os.symlink(os.readlink(entry.path), tmp / kind / entry.name)
    by_name = {f["name"]: f for f in meta["files"]}
    fields = None
    if any("bucket" in f for f in meta["files"]):
        fields = [
            {k: by_name[n][k] for k in ("bucket", "views", "channels") if k in by_name[n]}
            for n in new_names
        ]
    layout.write_rows(tmp, new_rows)
    sources = fingerprints.record(tmp, new_names) if fingerprints.FIELD in meta else None
    layout.write_files(tmp, new_names, new_rows, fields, sources)
    if (folder / captions.CAPTIONS).is_file():
        table = pa.ipc.open_file(pa.memory_map(str(folder / captions.CAPTIONS))).read_all()
        kept = table.filter(pa.array(keep))
        with (
            pa.OSFile(str(tmp / captions.CAPTIONS), "wb") as sink,
            pa.ipc.new_file(sink, kept.schema) as writer,
        ):
            writer.write_table(kept)
    report = json.loads((folder / "mix.json").read_text()) if (folder / "mix.json").exists() else {}
    report["num_samples"] = new_manifest.num_rows
    if "buckets" in report and fields is not None:
        index_files = [{"name": n, **f} for n, f in zip(new_names, fields, strict=True)]
        report["buckets"] = layout.bucket_counts((index_files, new_rows))
    (tmp / "mix.json").write_text(json.dumps(report, indent=1))
    note = json.loads((folder / NOTE).read_text()) if (folder / NOTE).exists() else {}
    note.setdefault("removals", []).append(digest)
    note.setdefault("rows_removed", {})[digest] = int(drop.sum())
    (tmp / NOTE).write_text(json.dumps(note, indent=1))
    replace_dir(tmp, folder)
    return int(drop.sum())


def removals(folder: Path) -> list[str]:
    """The digests of the removals that re-linked the set, in order ([]: never re-linked)."""
    note = folder / NOTE
    return json.loads(note.read_text()).get("removals", []) if note.exists() else []


def refusal(folder: Path, phase: str, checkpoint: Path | None) -> str | None:
    """Why the run of `phase` cannot resume from `checkpoint` on its re-linked set, or None
    (never re-linked, or it resumes: `crossed`)."""
    gone = removals(folder)
    if not gone:
        return None
    named = (
        f"phase set {folder} was re-linked by removal {', '.join(r[:12] for r in gone)} "
        "(sdpipe remove; records under <root>/<source>/removals/)"
    )
    if pq.read_metadata(folder / layout.MANIFEST).num_rows == 0:
        return (
            f"{named} and has no row left to resume on. Build more of its datasets "
            f"(build-latents), then delete runs/{phase}/checkpoints to mix and train the phase "
            "again"
        )
    lineage = Path(checkpoint) / LINEAGE_FILE if checkpoint is not None else None
    if not (lineage and lineage.is_file()) or json.loads(lineage.read_text()).get(
        "unrecorded_steps"
    ):
        # Its rows are unknown: a resume could not tell which removed rows the weights saw.
        return (
            f"{named}: the run's checkpoint {checkpoint} holds steps trained before sdpipe "
            "recorded lineage, so the removed rows it trained on cannot be told. Delete "
            f"runs/{phase}/checkpoints to train the phase again on the set without them"
        )
    return None


def crossed(folder: Path, checkpoint: Path | None) -> list[str]:
    """The removals a resume from `checkpoint` crosses (it resumes with `resume_remixed`): the
    set's, unless the checkpoint's last segment already trained on the set as it is now."""
    gone = removals(folder)
    if not gone:
        return []
    segments = read_segments(checkpoint)
    return [] if segments and segments[-1].set == manifest_digest(folder) else gone
