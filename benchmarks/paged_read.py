"""The paged roofline: a pass that only reads a step's K/V through the block tables
(`benchmarks/csrc/paged_read.cpp`), built on first use into the kernel build cache.

benchmarks/attention.py times it beside the plain read pass: the plain pass streams the cache as
one contiguous region, this one reads the scattered blocks a paged kernel must, so the distance
between the two is what the paged layout itself costs on the host, and the kernel's distance
from this pass is what is left to its own code.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.cache.attention.cpu import ISA_FLAGS, kernel_cache_dir

SOURCE = Path(__file__).parent / "csrc" / "paged_read.cpp"
CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi", *ISA_FLAGS["native"])


@functools.cache
def load_paged_read() -> ModuleType:
    """Build (first time, ~30 s) and import the read pass; cached for the process."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), str(CFLAGS).encode()):
        digest.update(part)
    # -march=native builds for this CPU only: the host's flags are part of the key.
    digest.update(Path("/proc/cpuinfo").read_bytes() if Path("/proc/cpuinfo").exists() else b"")
    key = digest.hexdigest()[:12]
    build_dir = kernel_cache_dir() / f"paged_read_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"pagedserve_paged_read_{key}",
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def read_paged_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:
    """The largest int32 among the bytes of every block the requests' tables reach up to their
    seq_len, K and V; the reads are the point, the value proves they happened."""
    return load_paged_read().read_paged_kv(key_cache, value_cache, block_tables, seq_lens)
