"""build-latents after a re-score by another scorer identity (issue 26, item 8's follow-up):
the shards are scored again and filter-pixels selects again from their new scores, though the
earlier run's tasks are cached; a run with nothing changed skips both."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.runtime.shards import ShardStats, read_stats, stats_path
from tests.conftest import write_small_catalog

pytestmark = pytest.mark.slow


def _catalog(dest: Path, watermark_side: int) -> Path:
    """The small catalog, its demo scorer (tiny-scoring) at `watermark_side`: another side is
    another scorer identity (its settings' digest)."""
    catalog = write_small_catalog(dest)
    models = yaml.safe_load((catalog / "models.yaml").read_text())
    models["tiny-scoring"]["watermark_side"] = watermark_side
    (catalog / "models.yaml").write_text(yaml.safe_dump(models))
    return catalog


def test_a_rescore_makes_filter_pixels_select_again(prefect_stack, tmp_path, monkeypatch):
    from prefect.logging.handlers import APILogWorker

    from catalog import load_catalog
    from flows.build_latents import build_latents
    from tasks.curation import score

    root = tmp_path / "data"

    def build(catalog: Path) -> tuple[dict, ShardStats]:
        monkeypatch.setenv("SDPIPE_CATALOG", str(catalog))
        state = build_latents(source="demo", data_root=str(root), workers=2, return_state=True)
        APILogWorker.drain_all()
        assert state.is_completed(), state.message
        identity = score.scorer_identity(load_catalog().scorer("tiny-scoring"))
        return identity, ShardStats.read(stats_path(root, "demo", "selected", "all"))

    first, before = build(_catalog(tmp_path / "first", 32))
    record = stats_path(root, "demo", "selected", "all")
    mtime = record.stat().st_mtime_ns
    build(_catalog(tmp_path / "same", 32))  # nothing changed: the selection stands
    assert record.stat().st_mtime_ns == mtime

    second, after = build(_catalog(tmp_path / "second", 64))
    assert second != first
    assert all(r.extra["scorer_identity"] == second for r in read_stats(root, "demo", "scores"))
    assert record.stat().st_mtime_ns != mtime, "filter-pixels kept the old scores' selection"
    assert before.extra["scorer_identity"] == first
    assert after.extra["scorer_identity"] == second
