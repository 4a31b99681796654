"""One torch thread for the tests of tiny models (fixture `one_torch_thread_per_module` in
tests/conftest.py; a test module opts in with `pytest.mark.usefixtures`)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def one_torch_thread():
    """The tiny model gains nothing from intra-op threads, and on a loaded 2-core machine their
    barriers stall a step 4-8x (a batch 10-20x). Every trainer run uses one (ranks and
    subprocesses too): CPU kernels split their sums by thread, so bitwise comparisons need the
    same count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
