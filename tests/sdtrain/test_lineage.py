"""A checkpoint's lineage is the trainer's own draw: the rows its micro-batches read, recorded here
through the trainer, against `sdpipe lineage`; the reverse query; a resume on a re-mixed set."""

from __future__ import annotations

import json
import shutil
from hashlib import sha256
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.cli import main as cli
from flows.lineage import flags_markdown
from sdtrain import train as train_module
from sdtrain.checkpoint import CheckpointError
from sdtrain.lineage import held_out_path, read_segments
from tasks.phases import lineage
from tasks.removal import lists
from tests.torch_threads import one_torch_thread

from .conftest import bucket_latents, write_phase_set


def url_of(key: str) -> str:
    return f"http://127.0.0.1:9/{key}.jpg"


def build_set(root, rows_per_shard=(16, 16), *, drop=0):
    """A legacy phase set at `<root>/phases/demo` (the `drop` first rows of shard 1 taken out:
    a re-mix after a removal), and the source's sample tables with url and caption."""
    phase = root / "phases" / "demo"
    if phase.exists():
        shutil.rmtree(phase)
    rng = np.random.default_rng(0)
    files = []
    for shard, n in zip(("00000", "00001"), rows_per_shard, strict=True):
        latents = bucket_latents(rng, n, 8, 8, channels=4)[:, 0]  # legacy [N, 4, h, w]
        files.append(
            {"name": f"demo-{shard}", "latents": latents[drop if shard == "00001" else 0 :]}
        )
    write_phase_set(phase, files)
    shards = root / "demo" / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    for shard, n in zip(("00000", "00001"), rows_per_shard, strict=True):
        keys = [f"demo/{shard}//{i:04d}" for i in range(n)]
        table = pa.table(
            {"key": keys, "url": [url_of(k) for k in keys], "caption": [f"c {k}" for k in keys]}
        )
        pq.write_table(table, shards / f"{shard}.parquet")
    return phase


def train_recording(config, monkeypatch) -> list[str]:
    """Train; the keys of the rows each micro-batch the trainer stepped on read, in order."""
    keys = pq.read_table(f"{config.phase_dir}/manifest.parquet")["key"].to_pylist()
    seen: list[list[str]] = []
    step = train_module.Trainer.forward_backward_step

    def recording(self, batch, **kwargs):
        seen.append([keys[i] for i in batch[-1].tolist()])
        return step(self, batch, **kwargs)

    monkeypatch.setattr(train_module.Trainer, "forward_backward_step", recording)
    with one_torch_thread():
        train_module.train(config)
    monkeypatch.setattr(train_module.Trainer, "forward_backward_step", step)
    return seen


def first_steps(micro_batches: list[list[str]], grad_accum: int, after: int = 0) -> dict:
    first: dict[str, int] = {}
    for i, batch in enumerate(micro_batches):
        for key in batch:
            first.setdefault(key, after + i // grad_accum + 1)
    return first


def listed(root, checkpoint, tmp_path) -> dict[str, int]:
    out = tmp_path / "rows.parquet"
    assert cli(["--data-root", str(root), "lineage", str(checkpoint), "--parquet", str(out)]) == 0
    table = pq.read_table(out)
    assert table["url"].to_pylist() == [url_of(k) for k in table["key"].to_pylist()]
    return dict(zip(table["key"].to_pylist(), table["first_step"].to_pylist(), strict=True))


def who_saw(root, capsys, *args) -> list[dict]:
    capsys.readouterr()
    assert cli(["--data-root", str(root), "lineage", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_lineage_is_the_trainers_draw(make_config, tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    phase = build_set(root)
    config = make_config(root / "runs" / "demo", phase_dir=str(phase), sample_every=0)
    drawn = train_recording(config, monkeypatch)
    assert len(drawn) == 12  # 6 steps x grad_accum 2, over 4 epochs of 3 micro-batches
    expected = first_steps(drawn, config.grad_accum)
    final = root / "runs" / "demo" / "final"
    assert listed(root, final, tmp_path) == expected
    four = root / "runs" / "demo" / "checkpoints" / "step-000004"
    assert listed(root, four, tmp_path) == first_steps(drawn[:8], config.grad_accum)

    one = next(k for k, s in expected.items() if s == 3)
    found = who_saw(root, capsys, "--url", url_of(one))
    assert {(f["checkpoint"], f["first_step"]) for f in found} == {
        (str(four), 3),
        (str(root / "runs" / "demo" / "checkpoints" / "step-000006"), 3),
        (str(final), 3),
    }
    all_keys = pq.read_table(phase / "manifest.parquet")["key"].to_pylist()
    never = next(k for k in all_keys if k not in expected)  # a validation row: never drawn
    assert who_saw(root, capsys, "--url", url_of(never)) == []
    listing = tmp_path / "list.txt"
    listing.write_text(f"{url_of(never)}\n{one}\n")  # a URL and a key
    assert len(who_saw(root, capsys, "--list", str(listing))) == 3

    # A removal since (the data root's blocklist, as `sdpipe remove` keeps it, naming the row by
    # its URL): status flags the checkpoints that drew the row, and the listing marks it.
    gone = {"key": ["demo/99999//0000"], "url": [url_of(one)]}
    lists.add_to_blocklist(root, "demo", pa.table(gone))
    assert {f["checkpoint"] for f in lineage.removed_flags(root)} == {
        f["checkpoint"] for f in found
    }
    assert f"`{final}` | 6 | 1 | 3 |" in flags_markdown(lineage.removed_flags(root))  # dashboard
    capsys.readouterr()
    cli(["--data-root", str(root), "status"])
    assert f"removed since: {final} trained on 1 removed rows" in capsys.readouterr().out
    out = tmp_path / "r.parquet"
    assert cli(["--data-root", str(root), "lineage", str(four), "--parquet", str(out)]) == 0
    marked = pq.read_table(out).filter(pa.compute.field("removed"))
    assert marked["key"].to_pylist() == [one]


@pytest.fixture(scope="module")
def trained(make_config, tmp_path_factory):
    """A run on a two-shard set whose sample tables carry `hash` and `sha256`: (root, the step
    each drawn key was first drawn for, config). Tests copy the root before changing it."""
    root = tmp_path_factory.mktemp("trained") / "root"
    phase = build_set(root)
    for shard in sorted((root / "demo" / "shards").glob("*.parquet")):
        table = pq.read_table(shard)
        hashes = [int(k[-4:]) * 1000 + int(k[5:10]) for k in table["key"].to_pylist()]
        digests = [sha256(k.encode()).hexdigest() for k in table["key"].to_pylist()]
        pq.write_table(table.append_column("hash", pa.array(hashes, pa.int64())).append_column(
            "sha256", pa.array(digests)), shard)  # fmt: skip
    config = make_config(root / "runs" / "demo", phase_dir=str(phase), sample_every=0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        drawn = first_steps(train_recording(config, monkeypatch), config.grad_accum)
    return SimpleNamespace(root=root, drawn=drawn, config=config)


def copied(trained, tmp_path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(trained.root, root)
    return root


def test_the_list_takes_what_sdpipe_remove_takes(trained, tmp_path, capsys):
    """`sdpipe lineage --list` resolves the metadata's hash and the image sha256 to the rows they
    name, in the sample tables or, once removed, in the data root's blocklist (main took both
    kinds of line for keys and found nothing)."""
    root, drawn = copied(trained, tmp_path), trained.drawn
    by_hash, by_sha = sorted(k for k in drawn if k.startswith("demo/00001"))[:2]
    listing = tmp_path / "list.txt"
    listing.write_text(f"{int(by_hash[-4:]) * 1000 + 1}\n{sha256(by_sha.encode()).hexdigest()}\n")
    found = who_saw(root, capsys, "--list", str(listing))
    final = next(f for f in found if f["checkpoint"].endswith("final"))
    assert final["num_rows"] == 2
    assert final["first_step"] == min(drawn[by_hash], drawn[by_sha])
    as_parquet = tmp_path / "list.parquet"
    pq.write_table(pa.table({"sha256": [sha256(by_sha.encode()).hexdigest()]}), as_parquet)
    assert who_saw(root, capsys, "--list", str(as_parquet))[-1]["num_rows"] == 1

    # Removed since: the row left the sample tables, the blocklist still names it.
    shard = root / "demo" / "shards" / "00001.parquet"
    table = pq.read_table(shard)
    gone = pa.compute.equal(table["key"], by_sha)
    lists.add_to_blocklist(root, "demo", table.filter(gone))
    pq.write_table(table.filter(pa.compute.invert(gone)), shard)
    assert who_saw(root, capsys, "--list", str(as_parquet))[-1]["num_rows"] == 1
    listing.write_text("0\n" + "ab" * 32 + "\n")  # a hash and a sha256 of no row
    assert who_saw(root, capsys, "--list", str(listing)) == []


def test_a_copy_kept_before_compression_reads_the_same(trained, tmp_path):
    """Copies are zstd-compressed with a dictionary source now, the held-out rows kept beside;
    one an older sdpipe kept (plain strings, uncompressed, no held-out rows) lists the same."""
    root, config = copied(trained, tmp_path), trained.config
    final = root / "runs" / "demo" / "final"
    ((_, copy, _, _),) = lineage.drawn_by_set(final)
    table = pa.ipc.open_file(pa.memory_map(str(copy))).read_all()
    assert pa.types.is_dictionary(table.schema.field("source").type)
    now = pa.Table.from_batches(lineage.lineage_batches(final))
    plain = table.set_column(1, "source", pa.compute.cast(table["source"], pa.string()))
    with pa.OSFile(str(copy), "wb") as sink, pa.ipc.new_file(sink, plain.schema) as writer:
        writer.write_table(plain)
    held_out_path(copy, config.seed, config.num_val_samples).unlink()
    assert pa.Table.from_batches(lineage.lineage_batches(final)).equals(now)


def test_a_resume_on_a_remixed_set_adds_a_segment(make_config, tmp_path, monkeypatch):
    root = tmp_path / "root"
    phase = build_set(root)
    run_dir = root / "runs" / "demo"
    config = make_config(run_dir, phase_dir=str(phase), sample_every=0, max_steps=3)
    before = train_recording(config, monkeypatch)
    build_set(root, drop=4)  # the same folder re-mixed: 28 rows, another digest
    with pytest.raises(CheckpointError):  # refused unless the resume allows a re-mix
        train_module.train(make_config(run_dir, phase_dir=str(phase), sample_every=0))
    resumed = make_config(run_dir, phase_dir=str(phase), sample_every=0, resume_remixed=True)
    after = train_recording(resumed, monkeypatch)
    assert len(before) == 6 and len(after) == 6

    segments = read_segments(run_dir / "final")
    assert [(s.first_step, s.last_step) for s in segments] == [(0, 3), (3, 6)]
    assert segments[0].set != segments[1].set
    by_set = lineage.drawn_by_set(run_dir / "final")
    assert len(by_set) == 2
    expected = [first_steps(before, 2), first_steps(after, 2, after=3)]
    for (_, copy, rows, steps), want in zip(by_set, expected, strict=True):
        keys = pa.ipc.open_file(pa.memory_map(str(copy))).read_all()["key"].to_numpy(False)
        assert dict(zip(keys[rows].tolist(), steps.tolist(), strict=True)) == want


def test_a_bucketed_run_two_ranks_and_one_draw_the_same(
    make_bucketed_config, tmp_path, monkeypatch, two_rank_run, one_rank_run
):
    """Batches of one bucket (flips on): the lineage is what the trainer read. Two ranks of
    batch 4 draw, together, the rows one rank of batch 8 draws, step for step."""
    config = make_bucketed_config(tmp_path / "run", sample_every=0)
    drawn = train_recording(config, monkeypatch)
    ((_, copy, rows, steps),) = lineage.drawn_by_set(tmp_path / "run" / "final")
    keys = pa.ipc.open_file(pa.memory_map(str(copy))).read_all()["key"].to_numpy(False)
    assert dict(zip(keys[rows].tolist(), steps.tolist(), strict=True)) == first_steps(drawn, 2)

    (two,), (one,) = (
        lineage.drawn_by_set(Path(c.run_dir) / "final") for c, *_ in (two_rank_run, one_rank_run)
    )
    assert read_segments(Path(two_rank_run[0].run_dir) / "final")[0].world_size == 2
    assert np.array_equal(two[2], one[2]) and np.array_equal(two[3], one[3])
