"""Mistakes a user can make end in one line naming the problem, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def sdpipe(*args: str, cwd: Path, catalog: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SDPIPE_DATA": str(cwd / "data")}
    env.pop("PREFECT_API_URL", None)
    if catalog is not None:
        env["SDPIPE_CATALOG"] = str(catalog)
    # The installed console script, as a user runs it (python -m would put cwd on sys.path).
    script = Path(sys.executable).with_name("sdpipe")
    return subprocess.run(
        [str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def assert_one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: "), done.stderr
    for needle in needles:
        assert needle in lines[0]


def test_bad_catalog_yaml(tmp_path, small_catalog):
    import shutil

    bad = tmp_path / "my-catalog"
    shutil.copytree(small_catalog, bad)
    text = (bad / "phases.yaml").read_text().replace("lr: 2.0e-06", "lr: fast", 1)
    (bad / "phases.yaml").write_text(text)
    assert_one_line_error(
        sdpipe("catalog", cwd=tmp_path, catalog=bad), "phases.yaml", "phase-4.lr", "'fast'"
    )


def test_broken_yaml_syntax(tmp_path, small_catalog):
    import shutil

    bad = tmp_path / "my-catalog"
    shutil.copytree(small_catalog, bad)
    (bad / "datasets.yaml").write_text("laion-broad: {source: laion, profile: [\n")
    assert_one_line_error(
        sdpipe("catalog", cwd=tmp_path, catalog=bad), "datasets.yaml", "not valid YAML"
    )


def test_missing_source_location(tmp_path):
    # vggface2 must be supplied by the user at ./vggface2; this folder has none.
    assert_one_line_error(
        sdpipe("build-latents", "vggface2", cwd=tmp_path), "vggface2", "does not exist"
    )


@pytest.mark.parametrize("phase", ["9", "phase-12"])
def test_unknown_phase(tmp_path, phase):
    assert_one_line_error(sdpipe("curriculum", phase, cwd=tmp_path), "unknown phase", "phase-")


def test_phase_before_its_predecessor(tmp_path):
    assert_one_line_error(
        sdpipe("curriculum", "phase-2", cwd=tmp_path), "phase-1", "run curriculum/phase-1 first"
    )


def test_missing_scoring_weights_fail_before_any_work(tmp_path, small_catalog):
    # A source whose profile needs LAION's scorers, without their files: the one line names
    # each missing file and where to get it, before index and repack would spend hours.
    import shutil

    import yaml

    catalog = tmp_path / "my-catalog"
    shutil.copytree(small_catalog, catalog)
    profiles = yaml.safe_load((catalog / "profiles.yaml").read_text())
    profiles["demo"]["scorer"] = "laion-scoring"
    (catalog / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    done = sdpipe("build-latents", "demo", cwd=tmp_path, catalog=catalog)
    assert_one_line_error(
        done, "weights file(s) not found", "sac+logos+ava1-l14-linearMSE.pth", "improved-aesthetic"
    )
    assert not (tmp_path / "data" / "demo").exists()


def test_an_edited_build_profile_fails_before_any_work(tmp_path):
    # The source's rows were selected under other settings: the line names the change and
    # the folders to delete, instead of "retry the flow run".
    from dataclasses import asdict

    from catalog import load_catalog
    from sdtrain.atomic import write_json_atomic
    from tasks.curation import filter as filter_stage
    from tasks.runtime.shards import ShardStats, stats_path

    profile = load_catalog().profile("demo")
    record = ShardStats(stage="filtered", source="demo", shard="all")
    record.extra = {"profile_settings": filter_stage.profile_settings(profile) | {"min_side": 64}}
    write_json_atomic(stats_path(tmp_path / "data", "demo", "filtered", "all"), asdict(record))
    assert_one_line_error(
        sdpipe("build-latents", "demo", cwd=tmp_path), "min_side: 64 -> 128", "delete"
    )


def test_a_failure_no_retry_can_fix_leads_the_flows_message():
    from prefect.states import Failed

    from flows.build_latents import _failed
    from flows.execution.stages import _retry_unless_permanent, failure_message
    from tasks.curation.score import ScoringWeightsError

    missing = ScoringWeightsError("scoring model 'x': weights file(s) not found: a (get b)")
    line = failure_message(missing)
    assert line == f"cannot succeed on a retry: {missing}"
    assert failure_message(OSError("connection reset")) == "OSError: connection reset"
    units = ["score-laion-00003", "score-laion-00007"]
    message = _failed(units, [f"score-laion-00003 {line}"])
    assert message.startswith("score-laion-00003 cannot succeed on a retry: scoring model 'x'")
    assert "retry the flow run" not in message and "2 shard task(s) failed" in message
    assert "retry the flow run" in _failed(units, [])
    # Prefect's retries skip what cannot succeed, and retry the rest.
    assert not _retry_unless_permanent(None, None, Failed(data=missing))
    assert _retry_unless_permanent(None, None, Failed(data=OSError("reset")))
