"""Fixtures for catalog tests: a writable copy of the shipped YAML to break on purpose."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from catalog.loader import PACKAGED_DIR


@pytest.fixture
def catalog_copy(tmp_path) -> Path:
    """A writable copy of the shipped YAML."""
    directory = tmp_path / "catalog"
    directory.mkdir()
    for path in PACKAGED_DIR.glob("*.yaml"):
        shutil.copy(path, directory / path.name)
    return directory
