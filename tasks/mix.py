"""mix: a phase's seeded sample of its datasets -> `phases/<phase>/` symlink set + manifest.

A dataset is a view: the encoded samples of its source whose keys its materialized view keeps
(`tasks.views`: the filter's SQL over the source's selection). Each dataset is drawn from its
own seeded stream, so editing one entry does not reshuffle the others; a dataset holding less
than its share fails the phase unless the phase allows it (`allow_short`). The phase folder is
built under a hidden temporary name and swapped into place, so a reader never sees half a phase
set; while the phase's run has checkpoints, its phase set is kept as it is (a resume trains on
the rows it started on).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import Catalog, Phase
from tasks import views
from tasks.shards import TMP_MARK, clean_temporaries, read_stats, replace_dir


class MixError(Exception):
    """A phase's datasets have nothing encoded to draw from, or less than the phase asks for."""


def encoded_samples(root: Path, source: str) -> pa.Table:
    """Every encoded sample of a source: (source, shard, latent_row, token_row, key)."""
    shards, latent_rows, token_rows, keys = [], [], [], []
    for s in read_stats(root, source, "latents"):
        n = len(s.extra["keys"])
        shards += [s.shard] * n
        latent_rows += list(range(n))
        token_rows += s.extra["token_rows"]
        keys += s.extra["keys"]
    return pa.table(
        {
            "source": pa.array([source] * len(keys), pa.string()),
            "shard": pa.array(shards, pa.string()),
            "latent_row": pa.array(latent_rows, pa.int64()),
            "token_row": pa.array(token_rows, pa.int64()),
            "key": pa.array(keys, pa.string()),
        }
    )


def dataset_view(root: Path, catalog: Catalog, dataset: str) -> pa.Table:
    """The encoded samples of a dataset: its materialized view's keys (`tasks.views`, built or
    refreshed here when missing or stale) that its source encoded."""
    ds = catalog.dataset(dataset)
    encoded = encoded_samples(root, ds.source)
    if encoded.num_rows == 0:
        return encoded.append_column("dataset", pa.array([], pa.string()))
    con = duckdb.connect()
    con.register("encoded", encoded)
    con.register("view_keys", views.view_keys(root, catalog, dataset))
    view = con.sql(
        "SELECT e.*, $dataset AS dataset FROM encoded e JOIN view_keys USING (key) "
        "ORDER BY e.shard, e.latent_row",
        params={"dataset": dataset},
    ).arrow()
    return view.read_all() if hasattr(view, "read_all") else view


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


def phase_set_for_run(root: Path, catalog: Catalog, phase: Phase) -> dict:
    """The phase set the phase's run trains on: the existing one while the run has checkpoints
    (a resume must see the rows it started on), else a fresh `build_phase_set`."""
    existing = root / "phases" / phase.name
    if run_has_checkpoints(root, phase.name) and (existing / "manifest.parquet").is_file():
        report = json.loads((existing / "mix.json").read_text())
        return {**report, "reused": True}
    return {**build_phase_set(root, catalog, phase), "reused": False}


def build_phase_set(root: Path, catalog: Catalog, phase: Phase) -> dict:
    """Draw each dataset's share (seeded), write manifest + symlinks; returns the mix report."""
    viewed = {e.dataset: dataset_view(root, catalog, e.dataset) for e in phase.mix}
    report = draw_counts(phase, {d: v.num_rows for d, v in viewed.items()})
    parts = []
    for r in report:
        view = viewed[r["dataset"]]
        order = dataset_stream(phase, r["dataset"]).permutation(view.num_rows)
        chosen = np.sort(order[: r["taken"]])
        parts.append(view.take(pa.array(chosen, pa.int64())))
    manifest = pa.concat_tables(parts)
    if manifest.num_rows == 0:
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
    pairs = {
        (s, sh)
        for s, sh in zip(manifest["source"].to_pylist(), manifest["shard"].to_pylist(), strict=True)
    }
    for source, shard in sorted(pairs):
        # Relative links keep the data root movable.
        (tmp / "latents" / f"{source}-{shard}.npy").symlink_to(
            Path("../../..") / source / "latents" / f"{shard}.npy"
        )
        (tmp / "tokens" / f"{source}-{shard}.parquet").symlink_to(
            Path("../../..") / source / "tokens" / f"{shard}.parquet"
        )
    pq.write_table(manifest, tmp / "manifest.parquet")
    summary = {
        "phase": phase.name,
        "seed": phase.seed,
        "num_samples": manifest.num_rows,
        "allow_short": phase.allow_short,
        "datasets": report,
    }
    (tmp / "mix.json").write_text(json.dumps(summary, indent=1))
    replace_dir(tmp, final)
    return summary
