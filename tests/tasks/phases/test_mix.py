"""The mix of a phase: short datasets are loud (or allowed, and then reported), each dataset has
its own seeded stream, a run with checkpoints keeps its phase set, and `sdpipe plan` says
before training what the phase will take, how many steps, how much disk and how long."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from catalog import Catalog, Dataset, FilterProfile, MixEntry, Model, Phase, Source
from flows.cli import main
from sdtrain import layout
from sdtrain.atomic import write_json_atomic
from sdtrain.data import PhaseSet
from tasks.curation import views as views_stage
from tasks.latents import latent_keys
from tasks.phases import mix, mix_read, plan
from tasks.runtime.shards import ShardStats, read_stats, stats_path

SIZES = {"a": 50, "b": 200, "c": 200}


def catalog(tmp_path: Path, **phases: Phase) -> Catalog:
    return Catalog(
        sources={
            n: Source(name=n, kind="url", location="x", license="x", profile="p") for n in SIZES
        },
        profiles={"p": FilterProfile(name="p")},
        datasets={n: Dataset(name=n, source=n, profile="p") for n in SIZES},
        phases=phases,
        models={"m": Model(name="m", resolution=512, unet_config={"x": 1})},
        directory=tmp_path,
    )


def phase(*entries: MixEntry, **settings) -> Phase:
    base = dict(
        name="p1", mix=entries, model="m", lr=1e-5, warmup_steps=0, epochs=2,
        cfg_dropout=0.1, min_snr_gamma=5.0, batch_size=4, num_val_samples=10,
    )  # fmt: skip
    return Phase(**(base | settings))


@pytest.fixture
def views(monkeypatch):
    """Each dataset's encoded view: `SIZES[name]` rows of one shard (the view machinery itself
    is tested in test_views.py; here only what mix draws from it)."""

    def view(root, catalog, dataset):
        n = SIZES[dataset]
        return pa.table(
            {
                "source": [dataset] * n,
                "shard": ["00000"] * n,
                "latent_row": list(range(n)),
                "token_row": list(range(n)),
                "key": [f"{dataset}-{i:04d}" for i in range(n)],
                "dataset": [dataset] * n,
            }
        )

    monkeypatch.setattr(mix, "dataset_view", view)


def test_a_short_dataset_fails_the_phase_naming_what_it_lacks(tmp_path, views):
    p = phase(MixEntry(dataset="a", count=100), MixEntry(dataset="b", count=10))
    with pytest.raises(mix.MixError) as e:
        mix.build_phase_set(tmp_path, catalog(tmp_path), p)
    message = str(e.value)
    assert "a: requested 100, available 50" in message and "b:" not in message
    assert "allow_short" in message and "\n" not in message
    assert not (tmp_path / "phases" / "p1").exists()


def test_allowed_short_takes_what_there_is_and_says_so(tmp_path, views):
    entries = (MixEntry(dataset="a", count=100), MixEntry(dataset="b", count=10))
    report = mix.build_phase_set(tmp_path, catalog(tmp_path), phase(*entries, allow_short=True))
    assert [(d["dataset"], d["taken"], d["short"]) for d in report["datasets"]] == [
        ("a", 50, True),
        ("b", 10, False),
    ]
    assert pq.read_table(tmp_path / "phases" / "p1" / "manifest.parquet").num_rows == 60
    assert mix.draw_counts(phase(*entries, allow_short=0.5), {"a": 50, "b": 200})[0]["taken"] == 50
    with pytest.raises(mix.MixError, match="allow_short below 0.6"):
        mix.draw_counts(phase(*entries, allow_short=0.6), {"a": 50, "b": 200})


def test_a_short_ratio_share_goes_to_the_others_by_their_ratios():
    p = phase(
        MixEntry(dataset="a", ratio=0.5),
        MixEntry(dataset="b", ratio=0.3),
        MixEntry(dataset="c", ratio=0.2),
        total=100,
        allow_short=True,
    )
    report = mix.draw_counts(p, {"a": 20, "b": 100, "c": 100})
    assert [d["taken"] for d in report] == [20, 48, 32]  # 30 missing: 18 to b, 12 to c
    assert [d["requested"] for d in report] == [50, 30, 20]


def test_each_dataset_has_its_own_stream(tmp_path, views):
    def drawn(count_a: int) -> dict[str, list[str]]:
        entries = (MixEntry(dataset="a", count=count_a), MixEntry(dataset="b", count=30))
        mix.build_phase_set(tmp_path, catalog(tmp_path), phase(*entries))
        rows = pq.read_table(tmp_path / "phases" / "p1" / "manifest.parquet").to_pylist()
        return {d: [r["key"] for r in rows if r["dataset"] == d] for d in ("a", "b")}

    before, after = drawn(20), drawn(40)
    assert after["b"] == before["b"]  # editing a's entry leaves b's draw alone
    assert set(before["a"]) < set(after["a"])  # and a's first 20 stay among its 40


def test_a_run_with_checkpoints_keeps_its_phase_set(tmp_path, views):
    p = phase(MixEntry(dataset="b", count=30))
    first = mix.phase_set_for_run(tmp_path, catalog(tmp_path), p)
    manifest = tmp_path / "phases" / "p1" / "manifest.parquet"
    keys = pq.read_table(manifest)["key"].to_pylist()
    assert not first["reused"]
    (tmp_path / "runs" / "p1" / "checkpoints" / "step-000002").mkdir(parents=True)
    SIZES["b"] = 150  # the view changed (say a refetch) while the run was stopped
    try:
        again = mix.phase_set_for_run(tmp_path, catalog(tmp_path), p)
        assert again["reused"] and pq.read_table(manifest)["key"].to_pylist() == keys
        (tmp_path / "runs" / "p1" / "checkpoints" / "step-000002").rmdir()
        fresh = mix.phase_set_for_run(tmp_path, catalog(tmp_path), p)
        assert not fresh["reused"] and fresh["datasets"][0]["available"] == 150
    finally:
        SIZES["b"] = 200


def test_plan_counts_steps_disk_and_eta_as_the_trainer_will(tmp_path, views):
    p = phase(MixEntry(dataset="a", count=50), MixEntry(dataset="b", count=60))
    cat = catalog(tmp_path, p1=p)
    report = plan.plan_phase(tmp_path, cat, p, ranks_per_node=2)
    # 110 samples, 10 held out: 100 / 2 ranks = 50 per rank = 12 batches of 4, x 2 epochs.
    assert (report["num_samples"], report["steps"], report["global_batch"]) == (110, 24, 8)
    assert report["latents_gb"] == pytest.approx(110 * 4 * 64 * 64 * 2 / 1e9, abs=1e-3)
    assert report["eta_s"] is None and "ETA: unknown" in plan.format_plan(report)
    run = tmp_path / "runs" / "p0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": "m"}))
    (run / "summary.json").write_text(json.dumps({"samples_per_s": 16.0}))
    report = plan.plan_phase(tmp_path, cat, p, ranks_per_node=2)
    assert report["eta_s"] == 24 * 8 / 16.0 and report["measured_on"] == "p0"
    text = plan.format_plan(report)
    assert "steps: 24" in text and "ETA: 0 min 12 s at 16.0 samples/s" in text


def test_sdpipe_plan_says_what_is_short_in_one_line(tmp_path, capsys):
    # Nothing encoded yet under this data root: the demo phase is short of all it asks for.
    assert main(["--data-root", str(tmp_path), "plan", "demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdpipe: error: phase 'demo' is short of encoded samples")
    assert "demo: requested 240, available 0" in err and "\n" not in err


# ---- mix over columns: the keys files, a view joined a shard at a time, the phase set's index


def encoded_source(root: Path, source: str, sizes: dict[str, int], legacy=()) -> dict:
    """Shards encoded as encode leaves them: latents, tokens (parquet + .npy) with two captions
    more than images, keys files with the token rows out of order; the `legacy` shards carry
    their keys in the stats record instead (encoded by an older sdpipe). Returns token keys."""
    rng = np.random.default_rng(len(source))
    token_keys = {}
    for shard, n in sizes.items():
        keys = [f"{source}/{shard}/{i:03d}" for i in range(n + 2)]
        ids = np.arange((n + 2) * 77, dtype=np.int32).reshape(n + 2, 77) + 1000 * int(shard)
        tokens = root / source / "tokens"
        tokens.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table(
                {
                    "key": keys,
                    "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), 77),
                }
            ),
            tokens / f"{shard}.parquet",
        )
        np.save(tokens / f"{shard}.npy", ids)
        token_rows = rng.permutation(n + 2)[:n].tolist()
        latents = root / source / "latents"
        latents.mkdir(parents=True, exist_ok=True)
        np.save(latents / f"{shard}.npy", rng.standard_normal((n, 4, 2, 2)).astype(np.float16))
        record = ShardStats(stage="latents", source=source, shard=shard, num_in=n, num_out=n)
        if shard in legacy:
            record.extra = {"keys": [keys[r] for r in token_rows], "token_rows": token_rows}
        else:
            latent_keys.write(root, source, shard, [keys[r] for r in token_rows], token_rows)
        write_json_atomic(stats_path(root, source, "latents", shard), asdict(record))
        token_keys[shard] = keys
    return token_keys


def planted_view(token_keys: dict, fraction: float, seed: int) -> pa.Table:
    """(shard, key) sorted: a seeded part of each shard's keys, encoded or not."""
    rng = np.random.default_rng(seed)
    rows = sorted(
        (shard, k) for shard, keys in token_keys.items() for k in keys if rng.random() < fraction
    )
    return pa.table({"shard": [s for s, _ in rows], "key": [k for _, k in rows]})


def old_selection(root, source, view, p: Phase, dataset: str, taken: int) -> list[dict]:
    """The mix before columns: every record's keys joined with the view, ordered by (shard,
    latent_row), then the first `taken` of the dataset's permutation, sorted."""
    wanted = set(view["key"].to_pylist())
    rows = []
    for record in read_stats(root, source, "latents"):
        t = latent_keys.read(root, source, record.shard, record)
        for i, (key, token_row) in enumerate(
            zip(t["key"].to_pylist(), t["token_row"].to_pylist(), strict=True)
        ):
            if key in wanted:
                rows.append(
                    {"source": source, "shard": record.shard, "latent_row": i,
                     "token_row": token_row, "key": key, "dataset": dataset}
                )  # fmt: skip
    order = mix.dataset_stream(p, dataset).permutation(len(rows))
    return [rows[c] for c in np.sort(order[:taken])]


@pytest.fixture
def encoded_root(tmp_path, monkeypatch):
    """Sources a (3 shards, one legacy) and b (2 shards), views of a seeded part of each."""
    keys_a = encoded_source(tmp_path, "a", {"00000": 40, "00001": 7, "00003": 55}, ("00001",))
    keys_b = encoded_source(tmp_path, "b", {"00000": 60, "00002": 30})
    planted = {"a": planted_view(keys_a, 0.8, 1), "b": planted_view(keys_b, 0.6, 2)}

    def row_groups(root, catalog, dataset):  # cut mid-shard, as ~1M-row groups are
        view = planted[dataset]
        cuts = [0, view.num_rows // 3, view.num_rows // 3 + 1, view.num_rows]
        return iter([view.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)])

    monkeypatch.setattr(views_stage, "view_key_groups", row_groups)
    monkeypatch.setattr(mix_read, "BATCH_ROWS", 16)  # many row groups of drawn rows
    return tmp_path, planted


def test_the_columnar_mix_draws_what_the_row_mix_drew(encoded_root):
    root, planted = encoded_root
    p = phase(MixEntry(dataset="a", count=50), MixEntry(dataset="b", count=33), seed=11)
    report = mix.build_phase_set(root, catalog(root), p)
    expected = old_selection(root, "a", planted["a"], p, "a", 50)
    expected += old_selection(root, "b", planted["b"], p, "b", 33)
    manifest = pq.read_table(root / "phases" / "p1" / "manifest.parquet")
    assert manifest.to_pylist() == expected
    assert report["num_samples"] == 83
    # Plain column types to a reader, as before (dictionaries are only the file's encoding).
    assert [str(t) for t in manifest.schema.types] == [
        "string", "string", "int64", "int64", "string", "string",
    ]  # fmt: skip
    assert manifest.column_names[:5] == ["source", "shard", "latent_row", "token_row", "key"]


def test_the_phase_set_reads_each_drawn_rows_latent_and_ids(encoded_root):
    root, _ = encoded_root
    p = phase(MixEntry(dataset="a", count=60), MixEntry(dataset="b", count=40), seed=3)
    mix.build_phase_set(root, catalog(root), p)
    phase_dir = root / "phases" / "p1"
    data = PhaseSet(phase_dir)
    assert layout.mapped_file(data.rows) and all(layout.mapped_file(t) for t in data.tokens)
    for i, row in enumerate(pq.read_table(phase_dir / "manifest.parquet").to_pylist()):
        latent, ids, _ = data[i]
        source_dir = root / row["source"]
        want = np.load(source_dir / "latents" / f"{row['shard']}.npy")[row["latent_row"]]
        assert torch.equal(latent, torch.from_numpy(want.astype(np.float32)))
        token_ids = np.load(source_dir / "tokens" / f"{row['shard']}.npy")
        assert torch.equal(ids, torch.from_numpy(token_ids[row["token_row"]].astype(np.int64)))
        keys = pq.read_table(source_dir / "tokens" / f"{row['shard']}.parquet")["key"]
        assert keys[row["token_row"]].as_py() == row["key"]


def test_tokens_rewritten_after_encode_are_checked_by_key(encoded_root):
    root, _ = encoded_root
    tokens = root / "b" / "tokens" / "00002.parquet"
    table = pq.read_table(tokens)
    pq.write_table(table, tokens)  # the same keys, a new file: checked, and it matches
    p = phase(MixEntry(dataset="b", count=20))
    mix.build_phase_set(root, catalog(root), p)
    pq.write_table(table.take(list(range(table.num_rows))[::-1]), tokens)  # rows moved
    with pytest.raises(mix.MixError, match=r"b/00002: its tokens changed since it was encoded"):
        mix.build_phase_set(root, catalog(root), p)


def test_a_shard_with_neither_keys_file_nor_keys_in_its_record_fails_naming_it(encoded_root):
    root, _ = encoded_root
    latent_keys.path(root, "b", "00000").unlink()
    with pytest.raises(mix.MixError, match=r"00000.keys.arrow: missing.*encode the shard again"):
        mix.dataset_view(root, catalog(root), "b")
