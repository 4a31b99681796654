"""The mix of a phase: short datasets are loud (or allowed, and then reported), each dataset has
its own seeded stream, a run with checkpoints keeps its phase set, and `sdpipe plan` says
before training what the phase will take, how many steps, how much disk and how long."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import Catalog, Dataset, FilterProfile, MixEntry, Model, Phase, Source
from flows.cli import main
from tasks import mix, plan

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
    report = plan.plan_phase(tmp_path, cat, p, world_size=2)
    # 110 samples, 10 held out: 100 / 2 ranks = 50 per rank = 12 batches of 4, x 2 epochs.
    assert (report["num_samples"], report["steps"], report["global_batch"]) == (110, 24, 8)
    assert report["latents_gb"] == pytest.approx(110 * 4 * 64 * 64 * 2 / 1e9, abs=1e-3)
    assert report["eta_s"] is None and "ETA: unknown" in plan.format_plan(report)
    run = tmp_path / "runs" / "p0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": "m"}))
    (run / "summary.json").write_text(json.dumps({"samples_per_s": 16.0}))
    report = plan.plan_phase(tmp_path, cat, p, world_size=2)
    assert report["eta_s"] == 24 * 8 / 16.0 and report["measured_on"] == "p0"
    text = plan.format_plan(report)
    assert "steps: 24" in text and "ETA: 0 min 12 s at 16.0 samples/s" in text


def test_sdpipe_plan_says_what_is_short_in_one_line(tmp_path, capsys):
    # Nothing encoded yet under this data root: the demo phase is short of all it asks for.
    assert main(["--data-root", str(tmp_path), "plan", "demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdpipe: error: phase 'demo' is short of encoded samples")
    assert "demo: requested 240, available 0" in err and "\n" not in err
