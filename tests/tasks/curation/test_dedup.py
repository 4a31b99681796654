"""Dedup: exact (sha256), near (pHash) and semantic (embedding) duplicates are found and the
stated survivor is kept: exact copies keep the smallest key, near and semantic copies keep the
largest image, then the higher aesthetic, then the smallest key. Near and semantic levels drop
a row only as a copy of a row that survives (greedy by rank), checked against all pairs."""

from __future__ import annotations

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from catalog import FilterProfile
from tasks.curation import dedup, filter_pixels, phash_dedup, score
from tasks.curation import filter as filter_stage
from tasks.curation.waterfall import Waterfall

PROFILE = FilterProfile(name="dedup", dedup=("sha256", "phash", "semantic"))


def unit(rng: np.random.Generator, dim: int = 64) -> np.ndarray:
    v = rng.normal(size=dim)
    return v / np.linalg.norm(v)


def greedy_over_all_pairs(duplicate: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """The survivor rule, by definition: best rank first, a row is dropped when a duplicate of
    it already survived. `duplicate` bool [N, N]."""
    survivors: list[int] = []
    lost = np.zeros(len(rank), bool)
    for i in np.argsort(rank):
        if survivors and duplicate[i, survivors].any():
            lost[i] = True
        else:
            survivors.append(i)
    return lost


def assert_one_survivor_per_group(duplicate: np.ndarray, rank: np.ndarray, lost: np.ndarray):
    """No two survivors are duplicates; every dropped row is a copy of a better survivor."""
    duplicate = duplicate.copy()
    np.fill_diagonal(duplicate, False)
    kept = ~lost
    assert not duplicate[np.ix_(kept, kept)].any()
    better_survivor = duplicate & kept[None, :] & (rank[None, :] < rank[:, None])
    assert better_survivor[lost].any(axis=1).all()


def flip(rng: np.random.Generator, h, n: int, positions: int = 64) -> np.uint64:
    """`h` with `n` distinct bits flipped among bits 0..positions-1."""
    bits = rng.choice(positions, n, replace=False).astype(np.uint64)
    return np.uint64(h) ^ (np.bitwise_or.reduce(np.uint64(1) << bits) if n else np.uint64(0))


def clustered_hashes(n: int, seed: int) -> np.ndarray:
    """Uniform hashes, groups of near copies 0-4 bits from a template, and a near-blank ball:
    0-3 bits set among 12 positions (dense: most pairs in it are near)."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
    templates = rng.integers(0, 2**64, n // 40, dtype=np.uint64)
    for i in range(n // 4):  # a quarter are near copies of a template
        hashes[i] = flip(rng, templates[rng.integers(len(templates))], rng.integers(0, 5))
    noisy = rng.choice(64, 12, replace=False).astype(np.uint64)
    for i in range(n // 4, n // 4 + n // 10):  # a tenth near-blank
        bits = noisy[rng.choice(12, rng.integers(0, 4), replace=False)]
        hashes[i] = np.bitwise_or.reduce(np.uint64(1) << bits) if bits.size else 0
    return hashes


def within(hashes: np.ndarray, k: int) -> np.ndarray:
    return np.bitwise_count(hashes[:, None] ^ hashes[None, :]) <= k


def test_phash_pairs_within_the_distance_and_no_further():
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**64, 2000, dtype=np.uint64)
    flips = {1: 1, 2: 4, 3: 5}  # row -> bits flipped from row 0
    for row, n in flips.items():
        hashes[row] = flip(rng, hashes[0], n)
    lost = dedup.phash_losers(hashes, np.arange(2000), max_distance=4)
    # Rows 1 (1 bit) and 2 (4 bits) are near row 0, which ranks first; row 3 (5 bits) is not.
    assert np.flatnonzero(lost).tolist() == [1, 2]


@pytest.mark.parametrize(
    ("max_distance", "num_blocks"), [(1, None), (1, 3), (3, None), (4, 6), (4, 7)]
)
def test_sorted_prefixes_find_every_near_pair_once(max_distance, num_blocks):
    # 6 and 7 blocks are the plans of 1M to 100M hashes at k = 4, forced here on 1,500; with
    # k = 1 and 3 blocks a key would be 43 bits: its first 32 are used.
    distinct = np.unique(clustered_hashes(1500, seed=max_distance))
    a, b = phash_dedup.near_pairs(distinct, max_distance, num_blocks=num_blocks)
    expected = np.argwhere(np.triu(within(distinct, max_distance), k=1))
    assert len(expected) > 100
    found = sorted(zip(a.tolist(), b.tolist(), strict=True))
    assert found == sorted(map(tuple, expected.tolist()))  # every pair, each once


@pytest.mark.parametrize("max_distance", [0, 3, 4, 6])
def test_phash_survivors_are_the_greedy_rule_over_all_pairs(max_distance):
    hashes = clustered_hashes(2000, seed=10 + max_distance)
    rank = np.random.default_rng(max_distance).permutation(2000)
    near = within(hashes, max_distance)
    expected = greedy_over_all_pairs(near, rank)
    assert expected.sum() > 100
    lost = dedup.phash_losers(hashes, rank, max_distance)
    np.testing.assert_array_equal(lost, expected)
    assert_one_survivor_per_group(near, rank, lost)
    # A subset (the rows earlier levels kept) is judged among itself, from the same pairs.
    include = np.random.default_rng(1).random(2000) < 0.6
    sub = np.flatnonzero(include)
    expected_sub = np.zeros(2000, bool)
    expected_sub[sub] = greedy_over_all_pairs(near[np.ix_(sub, sub)], rank[sub])
    index = phash_dedup.NearHashes(hashes, max_distance)
    np.testing.assert_array_equal(index.losers(rank, include), expected_sub)


def test_phash_survivor_is_the_best_ranked_copy():
    hashes = np.array([7, 7, 7, 2**40], np.uint64)
    lost = dedup.phash_losers(hashes, np.array([3, 1, 2, 0]), max_distance=2)
    assert lost.tolist() == [True, False, True, False]


def test_many_identical_hashes_are_one_group():
    # 20k copies of one hash would be 2e8 pairs if compared pairwise; collapsed, they are one.
    hashes = np.zeros(20_000, np.uint64)
    lost = dedup.phash_losers(hashes, np.arange(20_000)[::-1].copy(), max_distance=4)
    assert np.flatnonzero(~lost).tolist() == [19_999]


def test_a_chain_keeps_one_survivor_per_group():
    # a~b, b~c, c~d and nothing else: a survives and b is its copy; c's only better duplicate
    # (b) was dropped, so c survives and d is its copy. Two groups, {a, b} and {c, d}, one
    # survivor each: a row is never dropped as the copy of a dropped row.
    chain = np.array([0, 0b1111, 0b11111111, 0b111111111111], np.uint64)  # 4 bits apart
    lost = dedup.phash_losers(chain, np.arange(4), max_distance=4)
    assert lost.tolist() == [False, True, False, True]


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
    stats = filter_pixels.select_pixels(tmp_path, "src", PROFILE, scored=True)
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
        filter_pixels.select_pixels(tmp_path, "src", PROFILE, scored=False)
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
    stats = filter_pixels.select_pixels(tmp_path, "src", exact)
    selected = tmp_path / "src" / "selected"
    kept = {
        p.stem: pq.read_table(p)["key"].to_pylist() for p in sorted(selected.glob("[0-9]*.parquet"))
    }
    assert kept == {"00000": ["a1", "b2", "c3"], "00001": [], "00002": ["e5", "f9"]}
    assert stats.dropped == {"duplicate_sha256": 2} and stats.num_out == 5
