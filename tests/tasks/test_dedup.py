"""Dedup: exact (sha256), near (pHash, banded) and semantic (embedding) duplicates are found
and the stated survivor is kept: exact copies keep the smallest key, near and semantic copies
keep the largest image, then the higher aesthetic, then the smallest key."""

from __future__ import annotations

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from catalog import FilterProfile
from tasks import dedup, score
from tasks import filter as filter_stage
from tasks.waterfall import Waterfall

PROFILE = FilterProfile(name="dedup", dedup=("sha256", "phash", "semantic"))


def unit(rng: np.random.Generator, dim: int = 64) -> np.ndarray:
    v = rng.normal(size=dim)
    return v / np.linalg.norm(v)


def test_phash_pairs_within_the_distance_and_no_further():
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**64, 2000, dtype=np.uint64)
    flips = {1: 1, 2: 4, 3: 5}  # row -> bits flipped from row 0
    for row, n in flips.items():
        bits = rng.choice(64, n, replace=False)
        hashes[row] = hashes[0] ^ np.bitwise_or.reduce(np.uint64(1) << bits.astype(np.uint64))
    lost = dedup.phash_losers(hashes, np.arange(2000), max_distance=4)
    # Rows 1 (1 bit) and 2 (4 bits) are near row 0, which ranks first; row 3 (5 bits) is not.
    assert np.flatnonzero(lost).tolist() == [1, 2]


@pytest.mark.parametrize("max_distance", [0, 3, 6])
def test_banded_join_finds_what_comparing_all_pairs_finds(max_distance):
    rng = np.random.default_rng(max_distance)
    bases = rng.integers(0, 2**64, 150, dtype=np.uint64)
    hashes = bases[rng.integers(0, 150, 3000)]
    for i in range(3000):  # clusters of copies 0-8 bits apart: every distance occurs
        bits = rng.choice(64, rng.integers(0, 5), replace=False).astype(np.uint64)
        hashes[i] ^= np.bitwise_or.reduce(np.uint64(1) << bits) if bits.size else 0
    rank = rng.permutation(3000)
    distance = np.bitwise_count(hashes[:, None] ^ hashes[None, :])
    better_copy = (distance <= max_distance) & (rank[None, :] < rank[:, None])
    expected = better_copy.any(axis=1)
    assert expected.sum() > 100
    np.testing.assert_array_equal(dedup.phash_losers(hashes, rank, max_distance), expected)


def test_phash_survivor_is_the_best_ranked_copy():
    hashes = np.array([7, 7, 7, 2**40], np.uint64)
    lost = dedup.phash_losers(hashes, np.array([3, 1, 2, 0]), max_distance=2)
    assert lost.tolist() == [True, False, True, False]


def test_many_identical_hashes_are_one_group():
    # 20k copies of one hash would be 2e8 pairs if compared pairwise; collapsed, they are one.
    hashes = np.zeros(20_000, np.uint64)
    lost = dedup.phash_losers(hashes, np.arange(20_000)[::-1].copy(), max_distance=4)
    assert np.flatnonzero(~lost).tolist() == [19_999]


def test_a_row_whose_better_copy_is_itself_dropped_is_still_dropped():
    # a~b and b~c but a!~c: b has the better a, c has the better b. No two survivors are
    # duplicates and every dropped row has a better copy: the rule is not transitive closure.
    a = np.uint64(0)
    b = np.uint64(0b1111)  # 4 bits from a
    c = np.uint64(0b11111111)  # 4 bits from b, 8 from a
    lost = dedup.phash_losers(np.array([a, b, c]), np.array([0, 1, 2]), max_distance=4)
    assert lost.tolist() == [False, True, True]


@pytest.mark.parametrize("block", [3, 2048])
def test_semantic_duplicates_across_block_boundaries(block):
    rng = np.random.default_rng(0)
    emb = np.stack([unit(rng) for _ in range(10)])
    emb[7] = emb[1] + 0.01 * unit(rng)  # near-identical, in another block when block=3
    emb[9] = emb[1] + 0.01 * unit(rng)
    rank = np.arange(10)[::-1].copy()  # row 9 ranks best
    lost = dedup.semantic_losers(emb.astype(np.float16), rank, 0.95, block=block)
    assert np.flatnonzero(lost).tolist() == [1, 7]


def planted_source(fetched, scene, tmp_path):
    """Identical bytes, a resized re-encoded copy and near-identical embeddings, planted."""
    rng = np.random.default_rng(1)
    original_b = scene(1)
    small = Image.open(io.BytesIO(original_b)).resize((128, 128), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    small.save(buf, format="JPEG", quality=60)
    images = {
        "a0": scene(0),
        "a1": scene(0),  # the same bytes as a0
        "b0": buf.getvalue(),  # b1 resized + re-encoded, under a smaller key
        "b1": original_b,
        "c0": scene(2),
        "c1": scene(3),  # other pixels, near-identical embedding to c0
        "d0": scene(4),
    }
    sizes = {"b0": 128}
    emb = {k: unit(rng) for k in ("a0", "b1", "c0", "d0")}
    emb["a1"], emb["b0"] = emb["a0"], emb["b1"] + 0.02 * unit(rng)
    emb["c1"] = emb["c0"] + 0.02 * unit(rng)
    aesthetic = {"c0": 5.0, "c1": 6.0}
    rows, scores = [], {}
    for key, data in images.items():
        side = sizes.get(key, 256)
        rows.append({"key": key, "caption": key, "width": side, "height": side, "image": data})
        scores[key] = {
            "aesthetic": aesthetic.get(key, 5.5),
            "phash": score.phash(Image.open(io.BytesIO(data))),
            "embedding": emb[key],
        }
    fetched(tmp_path, "src", rows, scores=scores)


def test_three_levels_find_the_planted_duplicates_and_keep_the_intended_survivor(
    fetched, scene, tmp_path
):
    planted_source(fetched, scene, tmp_path)
    stats = filter_stage.select_pixels(tmp_path, "src", PROFILE, scored=True)
    kept = pq.read_table(tmp_path / "src" / "selected" / "00000.parquet")["key"].to_pylist()
    # a1: same bytes as a0 (smallest key); b0: smaller copy of b1 (largest image wins over
    # the smaller key); c0: same meaning as c1, lower aesthetic.
    assert kept == ["a0", "b1", "c1", "d0"]
    assert stats.dropped == {"duplicate_sha256": 1, "duplicate_phash": 1, "duplicate_semantic": 1}
    wf = Waterfall.read(tmp_path / "src" / "selected" / "waterfall.json")
    alone = {s.rule: s.alone for s in wf.steps}
    # Alone, pHash also finds the identical a1 and meaning also finds a1 and b0.
    assert alone == {
        "duplicate_key": 0,
        "duplicate_sha256": 1,
        "duplicate_phash": 2,
        "duplicate_semantic": 3,
    }


def test_near_and_semantic_dedup_need_the_score_stage(fetched, scene, tmp_path):
    planted_source(fetched, scene, tmp_path)
    with pytest.raises(filter_stage.ProfileError) as info:
        filter_stage.select_pixels(tmp_path, "src", PROFILE, scored=False)
    assert "'phash'" in str(info.value) and "scorer" in str(info.value)


def test_each_selected_shard_holds_its_own_kept_rows_in_key_order(fetched, tmp_path):
    # Kept rows are split back by the shard they were fetched in: a shard whose rows were all
    # dropped (here: copies of earlier shards' bytes, or failed downloads) gets an empty table.
    def rows(keys, digest=None):
        return [
            {"key": k, "caption": k, "width": 256, "height": 256, "sha256": digest or k}
            for k in keys
        ]

    fetched(tmp_path, "src", rows(["b2", "a1", "c3"]), shard="00000")
    fetched(tmp_path, "src", rows(["d1", "d2"], digest="a1"), shard="00001")
    fetched(
        tmp_path, "src", rows(["f9", "e5"]) + [{"key": "e0", "status": "http_404"}], shard="00002"
    )
    exact = FilterProfile(name="exact", dedup=("sha256",))
    stats = filter_stage.select_pixels(tmp_path, "src", exact)
    selected = tmp_path / "src" / "selected"
    kept = {
        p.stem: pq.read_table(p)["key"].to_pylist() for p in sorted(selected.glob("[0-9]*.parquet"))
    }
    assert kept == {"00000": ["a1", "b2", "c3"], "00001": [], "00002": ["e5", "f9"]}
    assert stats.dropped == {"duplicate_sha256": 2} and stats.num_out == 5
