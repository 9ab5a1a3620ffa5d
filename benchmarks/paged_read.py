"""The paged roofline: a pass that only reads a step's K/V through the block tables
(`benchmarks/csrc/paged_read.cpp`), built on first use into the kernel build cache.

benchmarks/attention.py times it beside the plain read pass: the plain pass streams the cache as
one contiguous region, this one reads the scattered blocks a paged kernel must, so the distance
between the two is what the paged layout itself costs on the host, and the kernel's distance
from this pass is what is left to its own code.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.cache.attention.build import BASE_CFLAGS, build_extension, build_key
from pagedserve.cache.attention.cpu import ISA_FLAGS, kernel_cache_dir, load_cpu_kernel

SOURCE = Path(__file__).parent / "csrc" / "paged_read.cpp"
# The kernel's prefetch helper, included by the source (part of the build key).
PREFETCH_HEADER = Path(__file__).parents[1] / "cache" / "attention" / "csrc" / "prefetch.h"
CFLAGS = (*BASE_CFLAGS, *ISA_FLAGS["native"])


@functools.cache
def load_paged_read() -> ModuleType:
    """Build (first time, ~30 s) and import the read pass; cached for the process."""
    key = build_key((SOURCE, PREFETCH_HEADER), str(CFLAGS))
    build_dir = kernel_cache_dir() / f"paged_read_{key}"
    name = f"pagedserve_paged_read_{key}"
    return build_extension(name, (SOURCE,), list(CFLAGS), build_dir, "the paged read pass")


def read_paged_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    into_l1: bool | None = None,
    blocks_at_once: int = 1,
) -> int:
    """The largest int32 among the bytes of every block the requests' tables reach up to their
    seq_len, K and V; the reads are the point, the value proves they happened.

    `blocks_at_once` 1 reads block by block, prefetching into L1 or L2 as `into_l1` says (None: as
    the attention kernel's native build does on this host); 2, 4 or 8 reads that many of a
    request's blocks at a time, line by line across them, with no software prefetch (the hardware
    prefetchers' rate over the same scattered blocks)."""
    if into_l1 is None:
        into_l1 = bool(load_cpu_kernel().prefetch_into_l1)
    return load_paged_read().read_paged_kv(
        key_cache, value_cache, block_tables, seq_lens, into_l1, blocks_at_once
    )
