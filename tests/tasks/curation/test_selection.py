"""filter-pixels is keyed by the scorer whose scores it read (issue 26, item 8's follow-up): a
re-score by another scorer selects again, and the tokens and latents of a shard whose kept rows
changed run again, those of the others stand."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

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


def _kept(names: list[str], rows_each: int, batch_rows: int):
    """Kept rows of the shards `names` in filename order, as batches of `batch_rows` (a run of
    one shard spans batches), produced one at a time: `given` counts the batches taken."""
    keys = [f"{n[-5:]}{i:07d}" for n in names for i in range(rows_each)]
    table = pa.table(
        {
            "key": keys,
            "caption": [f"caption {k}" for k in keys],
            "filename": [n for n in names for _ in range(rows_each)],
        }
    )
    given = []

    def batches():
        for batch in table.to_batches(max_chunksize=batch_rows):
            given.append(batch.num_rows)
            yield batch

    return pa.RecordBatchReader.from_batches(table.schema, batches()), table, given


def test_the_selection_is_written_shard_by_shard_as_the_kept_rows_stream(tmp_path):
    shards = [tmp_path / "src" / "shards" / f"{i:05d}.parquet" for i in range(4)]
    reader, table, given = _kept([str(shards[i]) for i in (0, 1, 3)], 10, 4)
    out = tmp_path / "src" / selection.STAGE
    seen_when = {}

    def watched():  # which files were written when each batch was asked for
        for batch in reader:
            seen_when[len(seen_when)] = sorted(p.name for p in out.glob("[0-9]*.parquet"))
            yield batch

    selection.write_shards(
        tmp_path, "src", pa.RecordBatchReader.from_batches(table.schema, watched()), shards
    )
    # Shard 0's file was written before the last batch was read: not the whole rows first.
    assert "00000.parquet" in seen_when[len(seen_when) - 1], seen_when
    assert "00001.parquet" not in seen_when[1], seen_when
    for i, shard in enumerate(shards):
        written = pq.read_table(out / shard.name)
        assert written.column_names == ["key", "caption"]
        expected = table.filter(pc.equal(table["filename"], str(shard)))
        assert written["key"].to_pylist() == expected["key"].to_pylist(), i
    assert pq.read_table(out / "00002.parquet").num_rows == 0  # a shard keeping nothing
    assert len(given) == 8


def test_kept_rows_out_of_filename_order_or_of_no_shard_are_refused(tmp_path):
    shards = [tmp_path / "src" / "shards" / f"{i:05d}.parquet" for i in range(2)]
    reader, _, _ = _kept([str(shards[0]), str(shards[1]), str(shards[0])], 3, 2)
    with pytest.raises(AssertionError, match="not in filename order"):
        selection.write_shards(tmp_path, "src", reader, shards)
    reader, _, _ = _kept([str(shards[0]), str(tmp_path / "elsewhere.parquet")], 3, 2)
    with pytest.raises(AssertionError, match="not listed as a shard"):
        selection.write_shards(tmp_path, "src", reader, shards)
