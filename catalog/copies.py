"""A changed copy of the packaged catalog, for tests and benchmarks: its YAML files copied to a
folder (the package's Python files stay behind), then entries changed file by file. A process
uses the copy once `SDPIPE_CATALOG` names it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import yaml

from catalog.loader import PACKAGED_DIR


def copy_catalog(dest: Path) -> Path:
    """The packaged catalog's YAML files copied to the new folder `dest`; returns `dest`."""
    shutil.copytree(PACKAGED_DIR, dest, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return dest


@contextlib.contextmanager
def edit_entries(path: Path) -> Iterator[dict]:
    """The entries of the catalog file `path`, to change in place in the block: written back
    when it ends without an error (under a temporary name renamed into place)."""
    entries = yaml.safe_load(path.read_text())
    yield entries
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(entries))
    os.replace(tmp, path)
