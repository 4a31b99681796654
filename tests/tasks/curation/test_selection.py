"""filter-pixels is keyed by the scorer whose scores it read (issue 26, item 8's follow-up): a
re-score by another scorer selects again, and the tokens and latents of a shard whose kept rows
changed run again, those of the others stand."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pyarrow.parquet as pq

from catalog import FilterProfile
from sdtrain.atomic import write_json_atomic
from tasks.curation import filter_pixels, score, selection
from tasks.runtime.shards import ShardStats, stats_path

PROFILE = FilterProfile(name="scored", min_aesthetic=6.0, dedup=("sha256",))
# Two identities of one scorer name (`score.scorer_identity`): other aesthetic weights.
FIRST = {"model": "mine", "config": "c0", "weights": {"aesthetic": "d0"}}
SECOND = {"model": "mine", "config": "c0", "weights": {"aesthetic": "d1"}}


def plant(fetched, scene, root: Path, aesthetic: dict[str, float]) -> None:
    """Shards 00000 (a0, a1) and 00001 (b0, b1), fetched and scored with `aesthetic`."""
    for shard, keys in (("00000", ["a0", "a1"]), ("00001", ["b0", "b1"])):
        seed = 10 * int(shard)
        rows = [
            {"key": k, "caption": k, "width": 256, "height": 256, "image": scene(seed + i)}
            for i, k in enumerate(keys)
        ]
        scores = {k: {"aesthetic": aesthetic[k], "embedding": [0.0] * 4} for k in keys}
        fetched(root, "src", rows, scores=scores, shard=shard)


def built_from_selection(root: Path, shard: str) -> None:
    """Records of tokens and latents built from the shard's selection."""
    for stage in selection.BUILT_FROM_SHARD:
        stats = ShardStats(stage=stage, source="src", shard=shard, num_in=1, num_out=1)
        write_json_atomic(stats_path(root, "src", stage, shard), asdict(stats))


def kept(root: Path, shard: str) -> list[str]:
    return pq.read_table(root / "src" / "selected" / f"{shard}.parquet")["key"].to_pylist()


def recorded(root: Path, stage: str, shard: str) -> bool:
    return stats_path(root, "src", stage, shard).exists()


def test_a_rescore_by_another_scorer_selects_again_and_reruns_what_changed(
    fetched, scene, tmp_path
):
    root = tmp_path
    plant(fetched, scene, root, {"a0": 7.0, "a1": 7.0, "b0": 7.0, "b1": 7.0})
    first = filter_pixels.select_pixels(root, "src", PROFILE, scored=True, scorer_identity=FIRST)
    assert first.extra["scorer_identity"] == FIRST and first.num_out == 4
    for shard in ("00000", "00001"):
        built_from_selection(root, shard)
    again = filter_pixels.select_pixels(root, "src", PROFILE, scored=True, scorer_identity=FIRST)
    assert again.skipped
    assert selection.selection_done(root, "src", FIRST)
    assert not selection.selection_done(root, "src", SECOND)

    # Re-scored by the second identity: b1 now fails the aesthetic rule.
    plant(fetched, scene, root, {"a0": 7.0, "a1": 7.0, "b0": 7.0, "b1": 5.0})
    new = filter_pixels.select_pixels(root, "src", PROFILE, scored=True, scorer_identity=SECOND)
    assert not new.skipped and new.extra["scorer_identity"] == SECOND
    assert (new.num_out, new.dropped) == (3, {"aesthetic": 1})
    assert (kept(root, "00000"), kept(root, "00001")) == (["a0", "a1"], ["b0"])
    assert selection.selection_done(root, "src", SECOND)
    # Shard 00001's tokens and latents were built from rows it no longer keeps: they run again.
    for stage in selection.BUILT_FROM_SHARD:
        assert recorded(root, stage, "00000") and not recorded(root, stage, "00001"), stage


def test_a_shard_scored_again_by_another_scorer_forgets_the_selection(fetched, scene, tmp_path):
    """Also a selection recorded before identities were (it names no scorer): the score stage,
    which knows the scores changed, removes its record."""
    root = tmp_path
    plant(fetched, scene, root, {"a0": 7.0, "a1": 7.0, "b0": 7.0, "b1": 7.0})
    filter_pixels.select_pixels(root, "src", PROFILE, scored=True)  # no identity recorded
    assert selection.selection_done(root, "src", FIRST)  # accepted as it is
    scored = ShardStats(stage=score.STAGE, source="src", shard="00001", num_in=2, num_out=2)
    scored.extra = {"scorer": "mine", "scorer_identity": FIRST}
    write_json_atomic(stats_path(root, "src", score.STAGE, "00001"), asdict(scored))

    assert score.forget_other_scorer(root, "src", "00001", FIRST)  # the same scorer: kept
    assert recorded(root, selection.STAGE, selection.WHOLE_STAGE)
    assert not score.forget_other_scorer(root, "src", "00001", SECOND)
    assert not recorded(root, selection.STAGE, selection.WHOLE_STAGE)
    assert not selection.selection_done(root, "src", SECOND)
