"""build-latents after a re-score by another scorer identity (issue 26, item 8's follow-up):
the shards are scored again and filter-pixels selects again from their new scores, though the
earlier run's tasks are cached; a run with nothing changed skips both. The HF export follows the
token shards: exported again when they change, skipped when not."""

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
    from tasks.latents import hf_export

    root = tmp_path / "data"

    def build(catalog: Path) -> tuple[dict, ShardStats]:
        monkeypatch.setenv("SDPIPE_CATALOG", str(catalog))
        state = build_latents(
            source="demo", data_root=str(root), workers=2, hf_dataset=True, return_state=True
        )
        APILogWorker.drain_all()
        assert state.is_completed(), state.message
        assert hf_export.export_done(root, "demo")  # made from the token shards there now
        identity = score.scorer_identity(load_catalog().scorer("tiny-scoring"))
        return identity, ShardStats.read(stats_path(root, "demo", "selected", "all"))

    first, before = build(_catalog(tmp_path / "first", 32))
    record = stats_path(root, "demo", "selected", "all")
    exported = stats_path(root, "demo", "hf", "all")
    mtime, hf_mtime = record.stat().st_mtime_ns, exported.stat().st_mtime_ns
    tokens = hf_export.token_inputs(root, "demo")
    build(_catalog(tmp_path / "same", 32))  # nothing changed: the selection stands
    assert record.stat().st_mtime_ns == mtime
    assert exported.stat().st_mtime_ns == hf_mtime  # nor the export

    second, after = build(_catalog(tmp_path / "second", 64))
    assert second != first
    assert all(r.extra["scorer_identity"] == second for r in read_stats(root, "demo", "scores"))
    assert record.stat().st_mtime_ns != mtime, "filter-pixels kept the old scores' selection"
    assert before.extra["scorer_identity"] == first
    assert after.extra["scorer_identity"] == second
    # The tiny scorers keep the same rows: the tokens and the export stand.
    assert hf_export.token_inputs(root, "demo") == tokens
    assert exported.stat().st_mtime_ns == hf_mtime
    # A shard tokenized again (as a re-selection that changes its rows makes it: its tokens
    # record removed) -> the export, cached by the earlier runs, is made again from it.
    stats_path(root, "demo", "tokens", "00001").unlink()
    build(_catalog(tmp_path / "third", 64))
    assert hf_export.token_inputs(root, "demo")["00001"] != tokens["00001"]
    assert exported.stat().st_mtime_ns != hf_mtime, "the HF export kept the old tokens"
