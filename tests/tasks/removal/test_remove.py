"""`sdpipe remove` on one demo-built root: every output of the source loses the listed rows.

The module builds the demo chain once (as test_demo_chain does), then an HF export, a phase set,
a kept generation of one shard (latents/spec-*, tokens/kept) and eval embeddings; each test
copies that root (a few MB) and removes a list mixing URLs, hashes, keys and a sha256 (some
absent) from the copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from flows.cli import main as cli
from flows.remove import run_removal as run_removal_flow
from sdtrain import fingerprints, layout, train
from sdtrain.lineage import read_segments
from sdtrain.run_data import manifest_digest
from tasks.latents import encode, hf_export, kept_latents, tokenize
from tasks.phases import lineage, mix
from tasks.phases.train import train_config_for_phase
from tasks.removal import apply, lists, phase_sets
from tasks.runtime.shards import read_stats, summarize
from tasks.sources import metadata
from tests.tasks.test_demo_chain import run_chain
from tests.torch_threads import one_torch_thread

SOURCE = "demo"
STAGES = ("metadata", "filtered", "shards", "scores", "selected", "tokens", "latents")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    catalog = load_catalog(PACKAGED_DIR)
    source = dataclasses.replace(
        catalog.source(SOURCE), options={"num_images": 60, "seed": 1}, samples_per_shard=24
    )
    root = tmp_path_factory.mktemp("built") / "data"
    profile, model = catalog.profile(source.profile), catalog.model(source.model)
    spec = encode.spec_for(catalog, SOURCE)
    run_chain(root, source, profile, model, catalog.scorer(profile.scorer), spec)
    phase = dataclasses.replace(catalog.phase("demo"), allow_short=True)
    mix.build_phase_set(root, catalog, phase)
    # A kept generation: shard 00000's linked files set aside, the shard made again.
    links = kept_latents.phase_links(root)
    assert kept_latents.keep_linked(root, SOURCE, "00000", links)
    assert kept_latents.keep_linked_tokens(root, SOURCE, "00000", links)
    for stage in ("tokens", "latents"):
        (root / SOURCE / stage / "00000.stats.json").unlink()
    tokenize.tokenize_shard(root, SOURCE, "00000")
    encode.encode_shard(root, SOURCE, "00000", model, spec=spec)
    hf_export.export_hf_dataset(root, SOURCE)
    # Eval embeddings (<source>/embeddings/<scorer>/), as the eval's memorisation check keeps.
    for p in sorted((root / SOURCE / "scores").glob("[0-9]*.parquet")):
        out = root / SOURCE / "embeddings" / profile.scorer / p.name
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pq.read_table(p, columns=["key", "embedding"]), out)
    write_eval(root)
    return SimpleNamespace(root=root, catalog=catalog, profile=profile, phase=phase)


EVAL = "runs/demo/eval/summary.json"


def write_eval(root: Path) -> None:
    """An eval of phase demo whose nearest-training-image pairs show the first fetched row of
    shard 00000 (the removal list names it) and the second (it does not)."""
    rows = pq.read_table(root / SOURCE / "shards" / "00000.parquet").to_pylist()
    ok = [r for r in rows if r["status"] == "success"]
    out = root / EVAL
    (out.parent / "images").mkdir(parents=True)
    scores = []
    for i in range(2):
        name = f"{i:04d}.png"
        Image.new("RGB", (16, 16), (90 * i, 40, 200)).save(out.parent / "images" / name)
        scores.append({"file": name, "seed": 0, "category": "things", "clip_score": 20.0,
                       "aesthetic": 5.0})  # fmt: skip
    pq.write_table(pa.Table.from_pylist(scores), out.parent / "images.parquet")
    worst = [
        {"file": f"{i:04d}.png", "category": "things", "source": SOURCE, "shard": "00000",
         "key": ok[i]["key"], "similarity": 0.9 - i / 10}
        for i in range(2)
    ]  # fmt: skip
    summary = {
        "phase": "demo", "seeds": [0], "num_images": 2, "num_steps": 2, "ema": True,
        "metrics": {"all": {"memorised": 0.5}},
        "memorisation": {"threshold": 0.85, "num_training_rows": 40, "worst": worst},
    }  # fmt: skip
    out.write_text(json.dumps(summary))


def removal_list(root: Path, path: Path) -> dict[str, dict]:
    """A list of a URL, a hash, a key, a sha256 (of fetched rows of two shards) and a row
    dropped at fetch, plus entries that match nothing; returns the rows it names by key."""
    rows0 = pq.read_table(root / SOURCE / "shards" / "00000.parquet").to_pylist()
    rows1 = pq.read_table(root / SOURCE / "shards" / "00001.parquet").to_pylist()
    ok0 = [r for r in rows0 if r["status"] == "success"]
    ok1 = [r for r in rows1 if r["status"] == "success"]
    failed = next(r for r in rows0 + rows1 if r["status"] != "success")
    named = [ok0[0], ok0[3], ok1[2], ok1[7], failed, ok0[5]]
    lines = [
        named[0]["url"], str(named[1]["hash"]), named[2]["key"], named[3]["sha256"],
        named[4]["url"], named[5]["key"],
        "http://absent.example/none.jpg", "1234", "ab" * 32, "no-such-key",
    ]  # fmt: skip
    path.write_text("# a takedown\n" + "\n".join(lines) + "\n")
    return {r["key"]: r for r in named}


def run_removal(built, root: Path, list_file: Path, **kwargs) -> dict:
    def export():
        hf_export.export_hf_dataset(root, SOURCE)

    return apply.remove(
        root, SOURCE, lists.read_list(list_file), built.profile, scored=True,
        export_hf=export, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def removed(built, tmp_path_factory):
    root = tmp_path_factory.mktemp("removed") / "data"
    shutil.copytree(built.root, root, symlinks=True)
    list_file = root.parent / "takedown.txt"
    named = removal_list(root, list_file)
    record = run_removal(built, root, list_file)
    summary = json.loads((root / EVAL).read_text())  # a later test deletes runs/
    return SimpleNamespace(root=root, list=list_file, named=named, record=record, summary=summary)


def signatures(built_root: Path, keys: set[str]) -> dict[str, list[bytes]]:
    """The bytes of the named samples in the built root that no other sample shares: image
    bytes (tars), latent rows (live and kept), token ids, scores' embeddings, captions."""
    d = built_root / SOURCE
    out: dict[str, list[bytes]] = {"image": [], "latent": [], "embedding": [], "caption": []}
    others: set[bytes] = set()
    for t in sorted(d.glob("shards/*.tar")):
        with tarfile.open(t) as tar:
            for m in tar:
                data = tar.extractfile(m).read()
                if m.name.endswith(".jpg"):
                    if m.name.split(".")[0] in keys:
                        out["image"].append(data)
                    else:
                        others.add(data)
    for keys_file in sorted(d.glob("latents/**/*.keys.arrow")):
        table = pa.ipc.open_file(pa.memory_map(str(keys_file))).read_all().to_pylist()
        for row in table:
            array = np.load(
                keys_file.with_name(f"{keys_file.name.split('.')[0]}.{row['bucket']}.npy")
            )
            data = array[row["bucket_row"]].tobytes()
            (out["latent"].append(data) if row["key"] in keys else others.add(data))
    for p in sorted(d.glob("scores/*.parquet")):
        for row in pq.read_table(p, columns=["key", "embedding"]).to_pylist():
            data = np.asarray(row["embedding"], np.float32).tobytes()
            (out["embedding"].append(data) if row["key"] in keys else others.add(data))
    captions, other_captions = set(), set()
    for p in sorted(d.glob("metadata/*.parquet")):
        for row in pq.read_table(p, columns=["key", "caption"]).to_pylist():
            (captions if row["key"] in keys else other_captions).add(row["caption"])
    out["caption"] = [c.encode() for c in captions - other_captions]
    return {kind: [b for b in found if b not in others] for kind, found in out.items()}


def output_files(root: Path):
    """Every file of the source's outputs and of the phase sets (links not followed)."""
    for base in (root / SOURCE, root / "phases"):
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(root)
            if p.is_symlink() or not p.is_file() or rel.parts[1] in ("mirror", lists.FOLDER):
                continue
            yield p


def decoded(p: Path) -> bytes:
    """A file's bytes, and a parquet file's values decoded (its pages are compressed)."""
    data = p.read_bytes()
    if p.suffix == ".parquet":
        table = pq.read_table(p)
        for column in table.columns:
            if pa.types.is_list(column.type) and pa.types.is_floating(column.type.value_type):
                for v in column.to_pylist():
                    data += np.asarray(v or [], np.float32).tobytes()
            elif pa.types.is_string(column.type):
                data += "\n".join(x or "" for x in column.to_pylist()).encode()
    return data


def test_no_byte_of_a_removed_sample_remains_in_any_output(built, removed):
    keys = set(removed.named)
    sigs = signatures(built.root, keys)
    assert sigs["image"] and sigs["latent"] and sigs["embedding"], sigs.keys()
    scanned = 0
    for p in output_files(removed.root):
        data = decoded(p)
        scanned += 1
        for kind, found in sigs.items():
            for sig in found:
                assert sig not in data, f"{kind} of a removed sample in {p}"
        if p.suffix == ".parquet" and "key" in pq.read_schema(p).names:
            assert not keys & set(pq.read_table(p, columns=["key"])["key"].to_pylist()), p
    assert scanned > 60
    # The kept generation and the HF export were rewritten too.
    assert any("spec-" in f for f in removed.record["files_rewritten"])
    assert any("tokens/kept" in f for f in removed.record["files_rewritten"])
    hf_keys = set()
    for arrow in (removed.root / SOURCE / "hf").rglob("*.arrow"):
        hf_keys |= set(pa.ipc.open_stream(pa.memory_map(str(arrow))).read_all()["key"].to_pylist())
    assert hf_keys and not hf_keys & keys
    # The record keeps identifiers, never images or captions.
    record_bytes = b"".join(p.read_bytes() for p in (removed.root / SOURCE / "removals").iterdir())
    for sig in sigs["caption"]:
        assert sig not in record_bytes


def test_counts_balance_with_the_removed_rows_counted_once(removed):
    summaries = [summarize(read_stats(removed.root, SOURCE, s)) for s in STAGES]
    meta = summaries[0]
    assert meta["dropped"]["removed"] == len(removed.named)
    for s, stats in zip(STAGES, summaries, strict=True):
        assert stats["num_in"] == stats["num_out"] + sum(stats["dropped"].values()), s
    for before, after in zip(summaries, summaries[1:], strict=False):
        assert after["num_in"] == before["num_out"]
    dropped = sum(sum(s["dropped"].values()) for s in summaries)
    assert summaries[-1]["num_out"] + dropped == meta["num_in"]
    # Each stage's count is what its files hold now.
    tokens = sum(
        pq.read_metadata(p).num_rows for p in (removed.root / SOURCE / "tokens").glob("*.parquet")
    )
    assert summaries[STAGES.index("tokens")]["num_out"] == tokens
    waterfall = json.loads((removed.root / SOURCE / "selected" / "waterfall.json").read_text())
    assert waterfall["num_in"] == summaries[STAGES.index("selected")]["num_in"]
    assert waterfall["num_out"] == summaries[STAGES.index("selected")]["num_out"]


def test_the_phase_set_is_relinked_to_the_same_samples(built, removed):
    folder = removed.root / "phases" / "demo"
    before = pq.read_table(built.root / "phases" / "demo" / layout.MANIFEST)
    after = pq.read_table(folder / layout.MANIFEST)
    keys = set(removed.named)
    assert not keys & set(after["key"].to_pylist())
    assert after.num_rows == before.num_rows - len(keys & set(before["key"].to_pylist())) > 0
    fingerprints.check(folder)  # its sources line up with it again

    def rows_by_key(set_dir: Path) -> dict[str, tuple[bytes, list]]:
        files, rows = layout.index_of_folder(set_dir)
        manifest = pq.read_table(set_dir / layout.MANIFEST)["key"].to_pylist()
        out = {}
        for key, (f, latent_row, token_row) in zip(manifest, rows.tolist(), strict=True):
            name = files[f]["name"]
            latents = np.load(set_dir / "latents" / f"{name}.npy")
            tokens = pq.read_table(set_dir / "tokens" / f"{name}.parquet")
            out[key] = (latents[latent_row].tobytes(), tokens["input_ids"][token_row].as_py())
        return out

    old, new = rows_by_key(built.root / "phases" / "demo"), rows_by_key(folder)
    assert new == {k: v for k, v in old.items() if k not in keys}
    assert removed.record["phase_sets"] == ["demo"]


def train_demo(root: Path, steps: int, *, resume_remixed: bool = False) -> Path:
    """The demo phase's run on the root's phase set, in-process, to `steps` (a checkpoint each)."""
    phase = load_catalog(PACKAGED_DIR).phase("demo")
    config = train_config_for_phase(
        phase, phase_dir=root / "phases" / "demo", run_dir=root / "runs" / "demo",
        resume_remixed=resume_remixed,
    )  # fmt: skip
    config = dataclasses.replace(
        config, max_steps=steps, batch_size=4, num_val_samples=4, checkpoint_every=1,
        validate_every=0, sample_every=0, log_every=1,
    )  # fmt: skip
    with one_torch_thread():
        train.train(config)
    return root / "runs" / "demo" / "final"


def keys_drawn(checkpoint: Path) -> list[set[str]]:
    """The keys a checkpoint trained on, per set it trained on (its lineage)."""
    out = []
    for _, copy, rows, _ in lineage.drawn_by_set(checkpoint):
        keys = pa.ipc.open_file(pa.memory_map(str(copy))).read_all()["key"].to_numpy(False)
        out.append(set(keys[rows].tolist()))
    return out


def test_a_run_resumes_on_the_relinked_set_with_a_new_lineage_segment(
    built, tmp_path, monkeypatch, capsys
):
    """Train, remove rows it drew (the flow's own path), status flags the checkpoint, the run
    resumes from it on the re-linked set: a second segment, without the removed rows."""
    root = tmp_path / "data"
    shutil.copytree(built.root, root, symlinks=True)
    monkeypatch.setenv("SDPIPE_CATALOG", str(PACKAGED_DIR))
    checkpoint = train_demo(root, 2)
    (first,) = keys_drawn(checkpoint)
    gone = sorted(first)[:3]
    list_file = tmp_path / "takedown.txt"
    list_file.write_text("\n".join(gone) + "\n")
    record = run_removal_flow(root, SOURCE, list_file)
    assert record["phase_sets"] == ["demo"] and record["num_rows"] == len(gone)
    lineage_copy = f"runs/demo/lineage/{read_segments(checkpoint)[0].set}.arrow"
    assert lineage_copy in record["not_rewritten"]  # it names the rows the checkpoint saw

    flagged = {f["checkpoint"]: f["num_rows"] for f in lineage.removed_flags(root)}
    assert flagged[str(checkpoint)] == len(gone)
    capsys.readouterr()
    assert cli(["--data-root", str(root), "status"]) == 0
    assert f"removed since: {checkpoint} trained on {len(gone)} removed rows" in (
        capsys.readouterr().out
    )

    report = mix.phase_set_for_run(root, built.catalog, built.phase)  # resumed on, not refused
    assert report["reused"] and report["remixed"] == [record["list_sha256"]]
    final = train_demo(root, 4, resume_remixed=True)
    segments = read_segments(final)
    assert [(s.first_step, s.last_step) for s in segments] == [(0, 2), (2, 4)]
    assert segments[1].set == manifest_digest(root / "phases" / "demo") != segments[0].set
    before, after = keys_drawn(final)
    assert before == first and after and not after & set(gone)
    # Resumed once on it: the set is the checkpoint's own now, a plain resume.
    assert mix.phase_set_for_run(root, built.catalog, built.phase)["remixed"] == []


def test_the_curriculum_trains_a_remixed_set_with_resume_remixed(tmp_path, monkeypatch):
    """The flow hands mix's `remixed` to the training: its run config says `resume_remixed`."""
    import logging

    from flows import curriculum

    phase = load_catalog(PACKAGED_DIR).phase("demo")
    configs = []

    def launch(config, *, on_line):
        configs.append(config)
        raise curriculum.TrainingFailed("stopped before it starts")

    logger = logging.getLogger("curriculum")
    monkeypatch.setattr(curriculum, "get_run_logger", lambda: logger)
    monkeypatch.setattr(curriculum, "export_secrets", lambda: None)
    monkeypatch.setattr(curriculum, "preflight", lambda name, root: (None, phase, ""))
    monkeypatch.setattr(curriculum.mix, "run_has_checkpoints", lambda *a: True)  # no plan
    monkeypatch.setattr(curriculum, "train_task", curriculum.train_task.fn)  # no task run
    monkeypatch.setattr(curriculum, "create_progress_artifact", lambda *a, **k: None)
    monkeypatch.setattr(curriculum, "training_slot", contextlib.nullcontext)
    monkeypatch.setattr(curriculum, "launch_training", launch)
    for remixed in ([], ["ab" * 32]):
        monkeypatch.setattr(curriculum, "mix_task", lambda *a, r=remixed: {"remixed": r})
        state = curriculum.curriculum.fn(phase="demo", data_root=str(tmp_path))
        assert state.message == "stopped before it starts"
    assert [c.resume_remixed for c in configs] == [False, True]


def test_a_set_a_removal_emptied_is_refused_naming_it(tmp_path):
    folder = tmp_path / "phases" / "demo"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"key": pa.array([], pa.string())}), folder / layout.MANIFEST)
    (folder / phase_sets.NOTE).write_text(json.dumps({"removals": ["ab" * 32]}))
    refused = phase_sets.refusal(folder, "demo", None)
    assert "re-linked by removal abababababab" in refused and "no row left" in refused
    assert "delete runs/demo/checkpoints" in refused


def test_a_checkpoint_without_lineage_is_refused_naming_the_removal(built, removed):
    """A checkpoint from before sdpipe recorded lineage cannot say which removed rows it saw."""
    checkpoints = removed.root / "runs" / "demo" / "checkpoints" / "step-00000004"
    checkpoints.mkdir(parents=True)
    try:
        with pytest.raises(
            mix.MixError, match=r"re-linked by removal .*lineage.*Delete runs/demo/checkp"
        ):
            mix.phase_set_for_run(removed.root, built.catalog, built.phase)
    finally:
        shutil.rmtree(removed.root / "runs")


def tree(root: Path) -> dict[str, bytes]:
    """The outputs' contents, less what differs between two copies by time or inode alone."""
    out = {}
    for p in output_files(root):
        rel = str(p.relative_to(root))
        if p.name in (fingerprints.MAPPED, "state.json", "dataset_info.json"):
            continue
        if p.name == layout.FILES:
            meta = json.loads(p.read_text())
            meta.pop(fingerprints.FIELD, None)
            out[rel] = json.dumps(meta, sort_keys=True).encode()
        elif p.name.endswith(".keys.arrow"):
            out[rel] = (
                pa.ipc.open_file(pa.memory_map(str(p))).read_all().to_pandas().to_json().encode()
            )
        elif p.name.endswith(".stats.json") and p.parent.name == "hf":
            continue
        elif p.suffix == ".arrow" and p.parent.parent.name == "hf":
            table = pa.ipc.open_stream(pa.memory_map(str(p))).read_all()
            out[rel] = table.to_pandas().to_json().encode()
        elif p.name.endswith(".stats.json"):  # a gallery's size holds the root's path
            stats = json.loads(p.read_text())
            stats["outputs"] = {k: v for k, v in stats["outputs"].items() if "gallery" not in k}
            out[rel] = json.dumps(stats, sort_keys=True).encode()
        else:  # galleries name their page by its path
            out[rel] = p.read_bytes().replace(str(root).encode(), b"ROOT")
    return out


class Killed(Exception):
    pass


@pytest.mark.parametrize("kill_at", [1, 9, 17, 24])
def test_a_removal_killed_then_run_again_ends_as_one_run(built, removed, tmp_path, kill_at):
    root = tmp_path / "data"
    shutil.copytree(built.root, root, symlinks=True)

    def kill(step: int) -> None:
        if step == kill_at:
            raise Killed

    with pytest.raises(Killed):
        run_removal(built, root, removed.list, on_step=kill)
    run_removal(built, root, removed.list)
    assert tree(root) == tree(removed.root)


def test_a_removal_killed_by_sigkill_then_run_again_ends_as_one_run(built, removed, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(built.root, root, symlinks=True)
    script = (
        "import os, signal, sys\n"
        "from tests.tasks.removal import test_remove as t\n"
        "from types import SimpleNamespace\n"
        "from pathlib import Path\n"
        "from catalog import load_catalog\n"
        "from catalog.loader import PACKAGED_DIR\n"
        "b = SimpleNamespace(profile=load_catalog(PACKAGED_DIR).profile('demo'))\n"
        "def kill(step):\n"
        "    if step == 13: os.kill(os.getpid(), signal.SIGKILL)\n"
        "t.run_removal(b, Path(sys.argv[1]), Path(sys.argv[2]), on_step=kill)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(root), str(removed.list)],
        cwd=Path(__file__).resolve().parents[3],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert done.returncode == -signal.SIGKILL
    run_removal(built, root, removed.list)
    assert tree(root) == tree(removed.root)


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_removing_twice_changes_nothing(built, removed, tmp_path):
    before = snapshot(removed.root)
    again = run_removal(built, removed.root, removed.list)
    assert again["already_done"]
    assert snapshot(removed.root) == before
    # The same entries in another file (another digest): nothing left to take out.
    other = tmp_path / "again.txt"
    other.write_text("\n".join(reversed(removed.list.read_text().splitlines())) + "\n")
    record = run_removal(built, removed.root, other)
    assert record["num_rows"] == 0 and record["files_rewritten"] == []
    after = snapshot(removed.root)
    changed = {k for k in after if after[k] != before.get(k)}
    assert all(k.startswith(f"{SOURCE}/{lists.FOLDER}/") for k in changed), changed


def test_a_later_build_drops_them_at_fetch_metadata(built, removed, tmp_path):
    """The data root's blocklist: a rebuild from the same upstream counts them `removed`."""
    root = tmp_path / "data"
    (root / SOURCE).mkdir(parents=True)
    shutil.copytree(removed.root / SOURCE / lists.FOLDER, root / SOURCE / lists.FOLDER)
    source = dataclasses.replace(
        built.catalog.source(SOURCE), options={"num_images": 60, "seed": 1}
    )
    location = str(sorted((removed.root / SOURCE / "mirror" / "metadata").glob("*.parquet"))[0])
    stats = metadata.fetch_metadata_shard(root, source, 0, location)
    assert stats.dropped["removed"] == len(removed.named)
    kept = set(pq.read_table(root / SOURCE / "metadata" / "00000.parquet")["key"].to_pylist())
    assert not kept & set(removed.named)


def test_widen_takes_the_same_picture_at_another_url(built, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(built.root, root, symlinks=True)
    rows = [
        r for p in sorted((root / SOURCE / "shards").glob("*.parquet"))
        for r in pq.read_table(p).to_pylist() if r["status"] == "success"
    ]  # fmt: skip
    by_sha: dict[str, list[str]] = {}
    for r in rows:
        by_sha.setdefault(r["sha256"], []).append(r["key"])
    twins = next(keys for keys in by_sha.values() if len(keys) > 1)
    list_file = tmp_path / "one.txt"
    list_file.write_text(twins[0] + "\n")
    narrow = apply.plan(root, SOURCE, lists.read_list(list_file), built.profile, scored=True)
    assert narrow["num_rows"] == 1
    record = run_removal(built, root, list_file, widen=True)
    assert record["num_rows"] >= len(twins)
    found = set(pq.read_table(lists.blocklist_path(root, SOURCE))["key"].to_pylist())
    assert set(twins) <= found
    assert phase_sets.applied(root / "phases" / "demo", record["list_sha256"]) or not (
        set(twins)
        & set(pq.read_table(built.root / "phases/demo/manifest.parquet")["key"].to_pylist())
    )


def test_an_eval_report_showing_a_removed_image_is_rewritten_without_it(built, removed):
    kept = json.loads((built.root / EVAL).read_text())["memorisation"]["worst"][1]
    memo = removed.summary["memorisation"]
    assert memo["worst"] == [kept] and memo["removed_pairs"] == 1
    assert memo["worst"][0]["key"] not in removed.named
    assert removed.record["republish"]["eval_reports"] == [EVAL]
    assert "filtered/waterfall.json" in removed.record["republish"]["galleries"]


def test_the_flow_publishes_the_galleries_and_eval_grid_again_without_them(built, removed):
    """The filter gallery and the eval grid artifacts as the build and the eval left them, then
    the remove flow: one version of each is left, drawn without the removed rows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.testing.utilities import prefect_test_harness

    from flows import evaluate, remove
    from flows.execution import stages
    from tasks.evaluation import eval_report

    root = removed.root.parent.parent / "flow" / "data"
    shutil.copytree(built.root, root, symlinks=True)
    d = root / SOURCE
    removed_key = json.loads((root / EVAL).read_text())["memorisation"]["worst"][0]["key"]
    grid_key = evaluate.artifact_key("demo", "grid")
    with prefect_test_harness(server_startup_timeout=120), get_client(sync_client=True) as c:
        stages.publish_waterfall(SOURCE, d / "filtered/waterfall.json", d / "filtered/gallery.html")
        summary = json.loads((root / EVAL).read_text())
        create = remove.create_markdown_artifact
        create(eval_report.grid_markdown(root, summary), key=grid_key)
        state = remove.remove(SOURCE, str(removed.list), data_root=str(root), return_state=True)
        assert state.is_completed(), state.message
        published = state.result()["republished"]
        assert grid_key in published
        assert stages.artifact_key(SOURCE, "filter", "gallery") in published
        for key in published:
            versions = c.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
            )
            assert len(versions) == 1, key
            assert not any(k in versions[0].data for k in removed.named), key
        grid = c.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[grid_key]))
        )
        assert removed_key not in grid[0].data and "Nearest training images" in grid[0].data
