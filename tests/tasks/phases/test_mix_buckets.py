"""mix and plan over shards encoded in aspect buckets (docs/training-data.md): a phase-set file
per (shard, bucket) whose rows read the right latents, legacy shards beside them unchanged, one
latent spec per dataset, the readers' new file fields, and `sdpipe plan`'s bucket occupancy
counted by the bucketed sampler's rule."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import MixEntry
from sdtrain import layout
from sdtrain.atomic import write_json_atomic
from sdtrain.bucket_batches import batches_per_bucket, bucketed_batches, small_buckets
from sdtrain.data import split_rows
from tasks.curation import views as views_stage
from tasks.latents import latent_keys
from tasks.phases import mix, mix_read, plan
from tasks.runtime.shards import ShardStats, stats_path
from tests.tasks.phases.test_mix import catalog, encoded_source, phase, planted_view

SPEC = {"vae": "tiny-vae", "plan": {"area": 256, "step": 8}, "views": 1, "channels": 4}


def bucketed_source(
    root: Path, source: str, shards: dict[str, list[str]], spec: dict = SPEC
) -> dict[str, list[str]]:
    """Shards encoded in buckets as encode leaves them: `shards[shard][i]` is the bucket of the
    shard's i-th encoded row. Per bucket `latents/<shard>.<WxH>.npy` [n, V, C, H/8, W/8] whose
    row for key number k holds k everywhere (a row read is checked by value), rows in reverse
    key order (bucket_row is not the keys row); tokens (parquet + .npy) with two captions more
    than images and token rows out of order; the keys file with bucket, bucket_row, sha256 and
    the `latent_spec`. Returns each shard's token keys."""
    rng = np.random.default_rng(len(source) + 7)
    token_keys = {}
    for shard, buckets in shards.items():
        n = len(buckets)
        keys = [f"{source}/{shard}/{i:03d}" for i in range(n + 2)]
        ids = np.arange((n + 2) * 77, dtype=np.int32).reshape(n + 2, 77) + 1000 * int(shard)
        tokens = root / source / "tokens"
        tokens.mkdir(parents=True, exist_ok=True)
        input_ids = pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), 77)
        pq.write_table(pa.table({"key": keys, "input_ids": input_ids}), tokens / f"{shard}.parquet")
        np.save(tokens / f"{shard}.npy", ids)
        token_rows = rng.permutation(n + 2)[:n]
        latents = root / source / "latents"
        latents.mkdir(parents=True, exist_ok=True)
        bucket_rows = np.zeros(n, np.int32)
        for bucket in sorted(set(buckets)):
            rows = np.flatnonzero(np.array(buckets) == bucket)[::-1]  # reverse key order
            bucket_rows[rows] = np.arange(len(rows))
            width, height = (int(x) for x in bucket.split("x"))
            shape = (len(rows), spec["views"], spec["channels"], height // 8, width // 8)
            values = token_rows[rows].astype(np.float16)  # the key number of each row
            array = np.broadcast_to(values.reshape(-1, 1, 1, 1, 1), shape).astype(np.float16)
            np.save(latents / f"{shard}.{bucket}.npy", array)
        table = latent_keys.table(
            [keys[r] for r in token_rows], token_rows, latent_keys.tokens_path(root, source, shard)
        )
        table = table.append_column("bucket", pa.array(buckets, pa.string()))
        table = table.append_column("bucket_row", pa.array(bucket_rows, pa.int32()))
        table = table.append_column("sha256", pa.array([""] * n, pa.string()))
        metadata = {**table.schema.metadata, latent_keys.SPEC_KEY: json.dumps(spec).encode()}
        latent_keys.write_table(
            latent_keys.path(root, source, shard), table.replace_schema_metadata(metadata)
        )
        record = ShardStats(stage="latents", source=source, shard=shard, num_in=n, num_out=n)
        write_json_atomic(stats_path(root, source, "latents", shard), asdict(record))
        token_keys[shard] = keys
    return token_keys


def plant_views(monkeypatch, planted: dict[str, pa.Table]) -> None:
    monkeypatch.setattr(views_stage, "view_key_groups", lambda root, cat, d: iter([planted[d]]))


def every_key(token_keys: dict[str, list[str]]) -> pa.Table:
    rows = sorted((shard, k) for shard, keys in token_keys.items() for k in keys)
    return pa.table({"shard": [s for s, _ in rows], "key": [k for _, k in rows]})


@pytest.fixture
def bucketed_root(tmp_path, monkeypatch):
    """Source a in buckets (2 shards, 4 buckets), source b legacy (2 shards), views of a seeded
    part of each."""
    rng = np.random.default_rng(5)
    names = ["16x16", "16x24", "24x16", "16x32"]
    keys_a = bucketed_source(
        tmp_path,
        "a",
        {
            "00000": [names[i] for i in rng.choice(4, 30, p=[0.4, 0.3, 0.2, 0.1])],
            "00002": [names[i] for i in rng.choice(3, 25)],
        },
    )
    keys_b = encoded_source(tmp_path, "b", {"00000": 20, "00001": 15})
    plant_views(monkeypatch, {"a": planted_view(keys_a, 0.8, 1), "b": planted_view(keys_b, 0.7, 2)})
    monkeypatch.setattr(mix_read, "BATCH_ROWS", 8)  # many row groups of drawn rows
    return tmp_path


def linked_latent(phase_dir: Path, files: list[dict], row: np.ndarray) -> np.ndarray:
    return np.load(phase_dir / "latents" / f"{files[row[0]]['name']}.npy")[row[1]]


def test_a_bucketed_shard_is_a_file_per_bucket_whose_rows_read_their_keys(bucketed_root):
    root = bucketed_root
    p = phase(MixEntry(dataset="a", count=40), seed=4)
    mix.build_phase_set(root, catalog(root), p)
    phase_dir = root / "phases" / "p1"
    manifest = pq.read_table(phase_dir / "manifest.parquet")
    assert manifest.column_names == [
        "source", "shard", "latent_row", "token_row", "key", "dataset", "bucket",
    ]  # fmt: skip
    assert manifest.schema.field("bucket").type == pa.string()  # a dictionary only on disk
    meta = json.loads((phase_dir / "files.json").read_text())
    files, rows = meta["files"], np.load(phase_dir / "rows.npy")
    assert rows.shape == (40, 3) and rows.dtype == np.int32
    for f in files:
        shard, bucket = f["name"].removeprefix("a-").split(".")
        assert (f["bucket"], f["views"], f["channels"]) == (bucket, 1, 4)
        link = phase_dir / "latents" / f"{f['name']}.npy"
        assert str(link.readlink()) == f"../../../a/latents/{shard}.{bucket}.npy"
        assert str((phase_dir / "tokens" / f"{f['name']}.npy").readlink()) == (
            f"../../../a/tokens/{shard}.npy"
        )
        assert (phase_dir / "tokens" / f"{f['name']}.parquet").resolve() == (
            root / "a" / "tokens" / f"{shard}.parquet"
        )
    names = [f["name"] for f in files]
    assert len(names) == len(set(names)) and {n.split(".")[0] for n in names} == {
        "a-00000",
        "a-00002",
    }
    for i, m in enumerate(manifest.to_pylist()):
        row = rows[i]
        name = files[row[0]]["name"]
        assert name == f"a-{m['shard']}.{m['bucket']}" and row[1] == m["latent_row"]
        latent = linked_latent(phase_dir, files, row)
        width, height = (int(x) for x in m["bucket"].split("x"))
        assert latent.shape == (1, 4, height // 8, width // 8)
        assert np.all(latent == row[2])  # the latent of this key: its token row's number
        token_keys = pq.read_table(root / "a" / "tokens" / f"{m['shard']}.parquet")["key"]
        assert token_keys[row[2]].as_py() == m["key"] and row[2] == m["token_row"]
    # A shard's drawn rows come by bucket: each file is one run of the index.
    assert np.count_nonzero(np.diff(rows[:, 0])) + 1 == len(files)
    for f, latent_rows, token_rows in zip(
        files, *layout.needed_rows(rows, len(files)), strict=True
    ):
        assert (f["latent_rows"], f["token_rows"]) == (latent_rows, token_rows)
    # The drawn keys are those of the columnar draw: the view's rows, the dataset's stream.
    view = mix.dataset_view(root, catalog(root), "a")
    expected = view.filter(mix.draw(p, "a", view.num_rows, 40))
    assert manifest["key"].to_pylist() == expected["key"].to_pylist()


def test_legacy_shards_beside_bucketed_ones_keep_their_file_and_say_their_square(bucketed_root):
    root = bucketed_root
    p = phase(MixEntry(dataset="b", count=20), MixEntry(dataset="a", count=30), seed=2)
    mix.build_phase_set(root, catalog(root), p)
    phase_dir = root / "phases" / "p1"
    manifest = pq.read_table(phase_dir / "manifest.parquet").to_pylist()
    files = json.loads((phase_dir / "files.json").read_text())["files"]
    rows = np.load(phase_dir / "rows.npy")
    legacy = [f for f in files if f["name"].startswith("b-")]
    assert [f["name"] for f in legacy] == ["b-00000", "b-00001"]
    assert all((f["bucket"], f["views"], f["channels"]) == ("16x16", 1, 4) for f in legacy)
    assert str((phase_dir / "latents" / "b-00000.npy").readlink()) == "../../../b/latents/00000.npy"
    for m, row in zip(manifest, rows, strict=True):
        if m["source"] == "b":
            assert m["bucket"] == "" and files[row[0]]["name"] == f"b-{m['shard']}"
            want = np.load(root / "b" / "latents" / f"{m['shard']}.npy")[m["latent_row"]]
            assert np.array_equal(linked_latent(phase_dir, files, row), want)
        else:
            assert np.all(linked_latent(phase_dir, files, row) == row[2])
    # The manifest alone indexes the same files and rows (a set whose rows.npy is gone).
    (phase_dir / layout.ROWS).unlink()
    derived_files, derived_rows = layout.index_of_folder(phase_dir)
    names = [f["name"] for f in files]
    assert sorted(names) == [f["name"] for f in derived_files]
    assert np.array_equal(
        np.array([names.index(derived_files[f]["name"]) for f in derived_rows[:, 0]]), rows[:, 0]
    )
    assert np.array_equal(derived_rows[:, 1:], rows[:, 1:])
    assert {f["name"]: f["bucket"] for f in derived_files} == {
        f["name"]: f["bucket"] for f in files
    }


def test_a_dataset_half_reencoded_under_another_spec_fails_naming_the_shards(tmp_path, monkeypatch):
    keys = bucketed_source(tmp_path, "a", {"00000": ["16x16"] * 6, "00001": ["16x24"] * 5})
    keys |= bucketed_source(tmp_path, "a", {"00002": ["16x16"] * 4}, SPEC | {"views": 2})
    plant_views(monkeypatch, {"a": every_key(keys)})
    with pytest.raises(mix.MixError) as e:
        mix.build_phase_set(tmp_path, catalog(tmp_path), phase(MixEntry(dataset="a", count=5)))
    message = str(e.value)
    assert "dataset 'a'" in message and "different latent specs" in message
    assert "00000, 00001: " in message and '00002: {"channels": 4,' in message
    assert "run build-latents for a" in message and "\n" not in message
    assert not (tmp_path / "phases" / "p1").exists()


def test_datasets_of_one_phase_may_differ_in_channels_each_file_says_its_own(tmp_path, monkeypatch):
    keys_a = bucketed_source(tmp_path, "a", {"00000": ["16x16"] * 6})
    keys_c = bucketed_source(tmp_path, "c", {"00000": ["16x16"] * 5}, SPEC | {"channels": 8})
    plant_views(monkeypatch, {"a": every_key(keys_a), "c": every_key(keys_c)})
    p = phase(MixEntry(dataset="a", count=6), MixEntry(dataset="c", count=5))
    mix.build_phase_set(tmp_path, catalog(tmp_path), p)
    files = json.loads((tmp_path / "phases" / "p1" / "files.json").read_text())["files"]
    assert {f["name"]: f["channels"] for f in files} == {"a-00000.16x16": 4, "c-00000.16x16": 8}
    latents = np.load(tmp_path / "phases" / "p1" / "latents" / "c-00000.16x16.npy")
    assert latents.shape == (5, 1, 8, 2, 2)


def test_readers_give_old_files_json_the_new_fields_from_the_latents(bucketed_root):
    root = bucketed_root
    mix.build_phase_set(root, catalog(root), phase(MixEntry(dataset="b", count=25), seed=1))
    phase_dir = root / "phases" / "p1"
    meta = json.loads((phase_dir / "files.json").read_text())
    assert all(set(f) == {"name", "latent_rows", "token_rows"} for f in meta["files"])
    assert "bucket" not in pq.read_schema(phase_dir / "manifest.parquet").names
    files, rows = layout.mapped_index(phase_dir)
    assert all((f["bucket"], f["views"], f["channels"]) == ("16x16", 1, 4) for f in files)
    assert layout.bucket_counts(phase_dir) == {"16x16": 25}
    assert layout.bucket_counts((files, rows), np.arange(10)) == {"16x16": 10}


def test_bucket_counts_of_a_phase_set(bucketed_root):
    root = bucketed_root
    mix.build_phase_set(root, catalog(root), phase(MixEntry(dataset="a", count=40), seed=8))
    phase_dir = root / "phases" / "p1"
    buckets = pq.read_table(phase_dir / "manifest.parquet")["bucket"].to_pylist()
    expected = {b: buckets.count(b) for b in set(buckets)}
    assert layout.bucket_counts(phase_dir) == expected and len(expected) == 4
    assert json.loads((phase_dir / "mix.json").read_text())["buckets"] == expected
    some = np.array([0, 3, 5, 7, 39])
    # Every bucket of the set, 0 where none of the rows asked for is in it.
    assert layout.bucket_counts(phase_dir, some) == {
        b: [buckets[i] for i in some].count(b) for b in expected
    }
    names, codes = layout.row_buckets(*layout.index_of_folder(phase_dir))
    assert [names[c] for c in codes] == buckets


@pytest.mark.parametrize(
    ("counts", "global_batch", "world_size", "batches"),
    [
        ([20, 11, 5, 9], 8, 2, [3, 2, 0, 1]),  # 20: 2 full + 4 left (a batch); 9: 1 left sits out
        ([16, 8, 7], 8, 2, [2, 1, 0]),  # whole batches only; 7 < one global batch: left out
        ([11, 12, 15], 8, 4, [1, 2, 2]),  # 3 left < 4 ranks: sit out; 4 and 7 left: a batch
        ([9, 1], 8, 1, [2, 0]),  # one rank: any leftover is a last batch
        ([], 8, 2, []),
    ],
)
def test_bucketed_batches_rule(counts, global_batch, world_size, batches):
    counts = np.array(counts, np.int64)
    assert batches_per_bucket(counts, global_batch, world_size).tolist() == batches
    assert bucketed_batches(counts, global_batch, world_size) == sum(batches)
    assert small_buckets(counts, global_batch).tolist() == [c < global_batch for c in counts]


def test_bucketed_batches_needs_whole_batches_per_rank():
    with pytest.raises(ValueError, match="not a whole batch per rank"):
        bucketed_batches(np.array([10]), 7, 2)


def test_plan_shows_bucket_occupancy_per_rank_and_the_small_buckets(tmp_path, monkeypatch):
    # 20 + 11 + 5 + 9 rows in four buckets; batch 4 x 2 ranks = global batch 8.
    buckets = ["16x16"] * 20 + ["16x24"] * 11 + ["24x16"] * 5 + ["16x32"] * 9
    keys = bucketed_source(tmp_path, "a", {"00000": buckets[:25], "00001": buckets[25:]})
    plant_views(monkeypatch, {"a": every_key(keys)})
    p = phase(MixEntry(dataset="a", count=45), num_val_samples=0, epochs=2)
    report = plan.plan_phase(tmp_path, catalog(tmp_path, p1=p), p, ranks_per_node=2)
    occupancy = {b["bucket"]: b for b in report["buckets"]}
    assert {b: o["rows"] for b, o in occupancy.items()} == {
        "16x16": 20, "16x24": 11, "24x16": 5, "16x32": 9,
    }  # fmt: skip
    assert {b: (o["full_batches"], o["last_batch"], o["batches_per_rank"]) for b, o in occupancy.items()} == {  # noqa: E501
        "16x16": (2, 4, 3), "16x24": (1, 3, 2), "24x16": (0, 0, 0), "16x32": (1, 0, 1),
    }  # fmt: skip
    assert occupancy["24x16"]["left_out"] == "small_bucket"
    assert report["left_out"] == {"small_bucket": {"buckets": ["24x16"], "samples": 5}}
    assert report["batches_per_rank"] == 6 and report["steps"] == 12  # 6 per epoch x 2
    # Listed by aspect ratio; latents: rows x 4 channels x (H/8 x W/8) x 2 bytes.
    assert [b["bucket"] for b in report["buckets"]] == ["16x32", "16x24", "16x16", "24x16"]
    assert report["latents_gb"] == round((20 * 4 + 11 * 6 + 5 * 6 + 9 * 8) * 4 * 2 / 1e9, 3)
    text = plan.format_plan(report)
    assert "global batches of 8 = 4 x 2 ranks" in text
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "16x16 20 2 4 3" in lines and "24x16 5 0 0 0 left out: small_bucket" in lines
    assert "left out (small_bucket): 1 bucket(s), 5 samples" in text
    assert "steps: 12" in text


def test_plan_counts_the_rows_that_sit_each_epoch_out(tmp_path, monkeypatch):
    """Issue 26: a bucket's leftover rows fewer than the ranks sit the epoch out (joined to
    the previous batch they gave a rank batch_size + 1 rows): `sdpipe plan` counts them as
    the sampler leaves them out (`leftover_rows`), and its steps are the sampler's."""
    from sdtrain.bucket_batches import leftover_rows
    from sdtrain.data import BucketBatchSampler

    buckets = ["16x16"] * 20 + ["16x24"] * 11 + ["24x16"] * 5 + ["16x32"] * 9
    keys = bucketed_source(tmp_path, "a", {"00000": buckets[:25], "00001": buckets[25:]})
    plant_views(monkeypatch, {"a": every_key(keys)})
    p = phase(MixEntry(dataset="a", count=45), num_val_samples=0, epochs=2)
    report = plan.plan_phase(tmp_path, catalog(tmp_path, p1=p), p, ranks_per_node=2)
    occupancy = {b["bucket"]: b["leftover_per_epoch"] for b in report["buckets"]}
    assert occupancy == {"16x16": 0, "16x24": 0, "24x16": 0, "16x32": 1}  # 9 = 8 + 1
    assert report["leftover_per_epoch"] == 1
    assert "leftover: 1 rows per epoch sit it out" in plan.format_plan(report)
    assert leftover_rows(np.array([20, 11, 5, 9]), 8, 2).tolist() == [0, 0, 0, 1]
    codes = np.repeat(np.arange(4, dtype=np.int32), [20, 11, 5, 9])
    rows, names = np.arange(45, dtype=np.int32), ["a", "b", "c", "d"]
    sampler = BucketBatchSampler(rows, codes, names, batch_size=4, seed=0, world_size=2)
    assert sampler.leftover_per_epoch == 1 and len(sampler) == report["batches_per_rank"]
    assert max(len(b) for b in sampler) <= 4


def test_plan_counts_the_buckets_the_mix_then_draws(bucketed_root):
    # Before the mix, plan counts the training rows per bucket that the phase set then has
    # (the validation hold-out taken off by its rows in the set).
    root = bucketed_root
    p = phase(MixEntry(dataset="b", count=21), MixEntry(dataset="a", count=37), seed=6)
    cat = catalog(root, p1=p)
    report = plan.plan_phase(root, cat, p, ranks_per_node=2)
    mix.build_phase_set(root, cat, p)
    train, _ = split_rows(58, 10, p.seed)
    counts = layout.bucket_counts(root / "phases" / "p1", train)
    assert {b["bucket"]: b["rows"] for b in report["buckets"] if b["rows"]} == counts
    assert sum(counts.values()) == 48
    batches = bucketed_batches(np.array(list(counts.values())), 8, 2)
    assert report["batches_per_rank"] == batches and report["steps"] == batches * 2


def test_plan_of_one_square_bucket_counts_as_the_plain_sampler(bucketed_root):
    root = bucketed_root
    p = phase(MixEntry(dataset="b", count=26))  # 26 - 10 held out = 16 / 2 ranks / 4 = 2
    report = plan.plan_phase(root, catalog(root, p1=p), p, ranks_per_node=2)
    assert not report["bucketed_sampler"] and report["batches_per_rank"] == 2
    assert report["steps"] == 4 and report["left_out"]["small_bucket"]["buckets"] == []
    assert "buckets: 16x16 (one bucket, no flips" in plan.format_plan(report)
    # Train-time captions need the epoch with each row: the trainer batches by bucket then.
    p = phase(MixEntry(dataset="b", count=26), train_time_captions=True)
    report = plan.plan_phase(root, catalog(root, p1=p), p, ranks_per_node=2)
    assert report["bucketed_sampler"] and report["batches_per_rank"] == 2


def test_a_keys_file_with_buckets_but_missing_bucket_rows_fails_naming_the_shard(
    tmp_path, monkeypatch
):
    keys = bucketed_source(tmp_path, "a", {"00000": ["16x16"] * 4})
    path = latent_keys.path(tmp_path, "a", "00000")
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    at = table.schema.get_field_index("bucket_row")
    table = table.set_column(at, "bucket_row", pa.array([0, None, 2, 3], pa.int32()))
    latent_keys.write_table(path, table)
    plant_views(monkeypatch, {"a": every_key(keys)})
    with pytest.raises(mix.MixError, match=r"a/00000: .* its bucket_row is missing .*00000.stats"):
        mix.build_phase_set(tmp_path, catalog(tmp_path), phase(MixEntry(dataset="a", count=4)))


def test_sdpipe_plan_prints_the_occupancy_per_rank(tmp_path, monkeypatch, capsys):
    from flows.cli import commands as cli

    buckets = ["16x16"] * 19 + ["24x16"] * 3
    keys = bucketed_source(tmp_path, "a", {"00000": buckets})
    plant_views(monkeypatch, {"a": every_key(keys)})
    p = phase(MixEntry(dataset="a", count=22), num_val_samples=0, epochs=1)
    monkeypatch.setattr(cli, "load_catalog", lambda: catalog(tmp_path, p1=p))
    assert cli.main(["--data-root", str(tmp_path), "plan", "p1", "--ranks", "2"]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    # 19 rows: 2 global batches of 8 + 3 left (>= 2 ranks: a short third); 3 rows: left out.
    assert "16x16 19 2 3 3" in lines and "24x16 3 0 0 0 left out: small_bucket" in lines
    assert (
        "left out (small_bucket): 1 bucket(s), 3 samples, each under one global batch: 24x16"
        in lines
    )
    assert any(line.startswith("steps: 3 (1 epochs") for line in lines)


# ---- a reused phase set is checked against its sources (issue 26, item 1)


def test_a_reused_phase_set_whose_sources_moved_is_refused_naming_the_file(bucketed_root):
    from sdtrain.data import PhaseSet

    root = bucketed_root
    p = phase(MixEntry(dataset="a", count=40), MixEntry(dataset="b", count=20), seed=4)
    assert not mix.phase_set_for_run(root, catalog(root), p)["reused"]
    (root / "runs" / "p1" / "checkpoints" / "step-000002").mkdir(parents=True)
    assert mix.phase_set_for_run(root, catalog(root), p)["reused"]  # unchanged: reused
    phase_dir = root / "phases" / "p1"
    PhaseSet(phase_dir)

    # b/00001 re-tokenized: the same keys, their rows in other positions.
    tokens = root / "b" / "tokens" / "00001.parquet"
    table = pq.read_table(tokens)
    order = list(range(table.num_rows))[::-1]
    pq.write_table(table.take(order), tokens)
    np.save(tokens.with_suffix(".npy"), np.load(tokens.with_suffix(".npy"))[order])
    with pytest.raises(mix.MixError, match=r"b/tokens/00001\.parquet changed since .*start"):
        mix.phase_set_for_run(root, catalog(root), p)
    with pytest.raises(ValueError, match=r"b/tokens/00001\.parquet changed since"):
        PhaseSet(phase_dir)
    pq.write_table(table, tokens)  # restored: the same digest, reused again
    np.save(tokens.with_suffix(".npy"), np.load(tokens.with_suffix(".npy"))[order])
    assert mix.phase_set_for_run(root, catalog(root), p)["reused"]

    # a/00000 encoded again (the same spec): the same keys, in other buckets and bucket rows, so
    # the latent and the caption would shift by different amounts. Its old files are gone (the
    # re-encode's own rows are what the source holds now).
    keys = latent_keys.read(root, "a", "00000")
    for f in (root / "a" / "latents").glob("00000.*.npy"):
        f.unlink()
    bucketed_source(root, "a", {"00000": keys["bucket"].to_pylist()[::-1]})
    with pytest.raises(mix.MixError, match=r"a/latents/00000\.keys\.arrow changed since"):
        mix.phase_set_for_run(root, catalog(root), p)
    with pytest.raises(ValueError, match=r"00000\.keys\.arrow changed since"):
        PhaseSet(phase_dir)
    shutil.rmtree(root / "runs" / "p1" / "checkpoints")  # started over: mixed anew, and it opens
    assert not mix.phase_set_for_run(root, catalog(root), p)["reused"]
    PhaseSet(phase_dir)


def count_digests(monkeypatch) -> list[tuple[str, ...]]:
    """The columns of every digest the fingerprints compute from now on."""
    from sdtrain import fingerprints

    digested: list[tuple[str, ...]] = []
    real = fingerprints.column_digest

    def counted(table: pa.Table, columns: tuple[str, ...]) -> str:
        digested.append(columns)
        return real(table, columns)

    monkeypatch.setattr(fingerprints, "column_digest", counted)
    return digested


def test_an_unchanged_phase_set_opens_without_digesting_its_sources(bucketed_root, monkeypatch):
    """Every rank opens the set: a file whose size, mtime and inode are as mixed is trusted
    (a digest is ~1 s per 1M rows); a touched file is digested, and the same rows pass."""
    from sdtrain.data import PhaseSet

    root = bucketed_root
    mix.build_phase_set(root, catalog(root), phase(MixEntry(dataset="b", count=20), seed=4))
    phase_dir = root / "phases" / "p1"
    digested = count_digests(monkeypatch)
    PhaseSet(phase_dir)
    assert digested == []

    tokens = root / "b" / "tokens" / "00001.parquet"
    st = tokens.stat()
    os.utime(tokens, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: the same rows
    PhaseSet(phase_dir)
    assert digested == [("key",)]


def test_a_keys_file_rewritten_in_place_at_its_size_is_refused(bucketed_root, monkeypatch):
    """Same size, same inode, other rows: its mtime moved, so it is digested and refused."""
    from sdtrain.data import PhaseSet

    root = bucketed_root
    mix.build_phase_set(root, catalog(root), phase(MixEntry(dataset="a", count=40), seed=4))
    phase_dir = root / "phases" / "p1"
    path = latent_keys.path(root, "a", "00000")
    before = path.stat()
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table.take(list(range(table.num_rows))[::-1]))
    with open(path, "r+b") as f:  # in place: the inode stays
        f.write(sink.getvalue().to_pybytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))  # the least a clock moves
    after = path.stat()
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    with pytest.raises(ValueError, match=r"a/latents/00000\.keys\.arrow changed since"):
        PhaseSet(phase_dir)


def test_a_phase_set_mixed_without_stats_is_digested_at_open(bucketed_root, monkeypatch):
    from sdtrain import fingerprints
    from sdtrain.data import PhaseSet

    root = bucketed_root
    mix.build_phase_set(root, catalog(root), phase(MixEntry(dataset="a", count=40), seed=4))
    files = root / "phases" / "p1" / layout.FILES
    meta = json.loads(files.read_text())
    sources = meta[fingerprints.FIELD]
    for digests in sources.values():
        assert set(digests) == {"keys", "tokens", "keys_stat", "tokens_stat"}
        del digests["keys_stat"], digests["tokens_stat"]  # as sdpipe wrote it before stats
    files.write_text(json.dumps(meta))
    digested = count_digests(monkeypatch)
    PhaseSet(root / "phases" / "p1")
    assert len(digested) == 2 * len(sources)
