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
