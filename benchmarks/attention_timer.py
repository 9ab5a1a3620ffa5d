"""Wall time of the attention calls of an engine's steps (K/V store + attend), for the step and peer
benchmarks, without changing which path the engine takes.

The engine's decoder layers call the CPU backend's C++ module themselves (engine/direct_layer.py)
only where the backend is a `CpuPagedAttention`: a wrapper around the backend would send every
layer back to Hugging Face's module path, and the benchmark would time an engine slower than the
one users run (2-3 ms a decode step at batch 64). So for that backend the timer wraps its C++
module, which both paths call; any other backend is wrapped whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedserve.cache.attention.cpu import CpuPagedAttention

# The calls that store and attend: on the CPU backend's C++ module, or on any backend.
KERNEL_CALLS = ("store_kv", "paged_attention")
BACKEND_CALLS = ("store_kv", "forward")


class _Timed:
    """`inner` with each of `calls` timed into `record(seconds)`; every other attribute its own."""

    def __init__(self, inner: Any, calls: tuple[str, ...], record: Callable[[float], None]) -> None:
        self._inner = inner
        for name in calls:  # wrapped once: instance attributes, found before __getattr__
            setattr(self, name, _timed(getattr(inner, name), record))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _timed(call: Callable[..., Any], record: Callable[[float], None]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)

    return timed


def time_attention(engine: Any, record: Callable[[float], None]) -> None:
    """From now on, call `record(seconds)` after each store and attention call of `engine`'s steps."""
    backend = engine.runner.backend
    if isinstance(backend, CpuPagedAttention):
        backend._kernel = _Timed(backend._kernel, KERNEL_CALLS, record)  # what `.kernel` returns
    else:
        engine.runner.backend = _Timed(backend, BACKEND_CALLS, record)
