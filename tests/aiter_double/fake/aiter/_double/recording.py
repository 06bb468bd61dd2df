"""Counts the public functions a caller invokes, so tests can assert which kernels really ran.

Only outermost calls count: a double function that calls another public one (fused_moe quantising
through get_hip_quant) records itself, not its helpers. activate() rebinds CALLS to its own Counter.
"""
from __future__ import annotations

import collections
import functools
import threading

CALLS: collections.Counter = collections.Counter()
_depth = threading.local()


def recorded(name: str | None = None):
    """Decorator: count each outermost call under `name` (default: the function's own name)."""
    def wrap(fn):
        key = name or fn.__name__

        @functools.wraps(fn)
        def call(*args, **kwargs):
            depth = getattr(_depth, "value", 0)
            if depth == 0:
                CALLS[key] += 1
            _depth.value = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                _depth.value = depth
        return call
    return wrap
