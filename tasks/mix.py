"""mix: a phase's seeded sample of its datasets -> `phases/<phase>/` symlink set + manifest.

A dataset is a view: the encoded samples of its source whose keys its materialized view keeps
(`tasks.views`: the filter's SQL over the source's selection). The phase folder is built under
a hidden temporary name and swapped into place, so a reader never sees half a phase set.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import Catalog, Phase
from tasks import views
from tasks.shards import TMP_MARK, clean_temporaries, read_stats


class MixError(Exception):
    """A phase's datasets have nothing encoded to draw from."""


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


def build_phase_set(root: Path, catalog: Catalog, phase: Phase) -> dict:
    """Draw each dataset's share (seeded), write manifest + symlinks; returns the mix report."""
    parts, report = [], []
    rng = np.random.default_rng(phase.seed)
    for entry in phase.mix:
        view = dataset_view(root, catalog, entry.dataset)
        requested = entry.count if entry.count is not None else round(entry.ratio * phase.total)
        take = min(requested, view.num_rows)
        chosen = np.sort(rng.permutation(view.num_rows)[:take])
        parts.append(view.take(pa.array(chosen, pa.int64())))
        report.append(
            {
                "dataset": entry.dataset,
                "requested": requested,
                "available": view.num_rows,
                "taken": take,
            }
        )
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
        "datasets": report,
    }
    (tmp / "mix.json").write_text(json.dumps(summary, indent=1))
    if final.exists():
        old = phases_dir / f".{phase.name}.old{TMP_MARK}{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return summary
