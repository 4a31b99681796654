"""Process-wide objects built on first use (tokenizer, VAE, scorers, CLIP models), safe to build
from several task threads at once.

One re-entrant lock serializes every first build and every import of a library that imports
lazily: transformers' and diffusers' lazy modules are not thread-safe (4 threads making the first
`from transformers import CLIPTokenizer` in a fresh process: 2-3 ImportErrors), and builders nest
(an encoder builds its VAE, the fast tokenizer the reference one).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

BUILD_LOCK = threading.RLock()


def once(fn: Callable[..., T]) -> Callable[..., T]:
    """`functools.cache` for builders: one call per argument tuple and process, under
    BUILD_LOCK, so concurrent first callers wait for the one build instead of racing it."""
    built: dict[tuple, T] = {}

    @functools.wraps(fn)
    def get(*args):
        try:
            return built[args]
        except KeyError:
            pass
        with BUILD_LOCK:
            if args not in built:
                built[args] = fn(*args)
            return built[args]

    get.cache_clear = built.clear  # type: ignore[attr-defined]
    return get
