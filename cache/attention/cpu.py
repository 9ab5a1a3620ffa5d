"""CPU paged attention: a C++/OpenMP kernel (csrc/paged_attention.cpp) built on first use.

The same extension carries the bfloat16 RMSNorm (csrc/rms_norm.cpp, used by engine/fused_norm.py),
rotary embedding (csrc/rope.cpp, engine/fused_attention.py) and SiLU-and-multiply
(csrc/silu_mul.cpp, engine/fused_mlp.py), the float32 linear for decode-sized batches
(csrc/skinny_linear.cpp, engine/skinny_linear.py), the decode-batch linear of panel-packed weights
(csrc/panel_linear.cpp, engine/panel_linear.py) and the K/V store (csrc/store_kv.cpp,
`CpuPagedAttention.store_kv`); csrc/bindings.cpp binds them all into one Python module.

The build is cached under ``$PAGEDSERVE_CACHE/kernels`` (default ``~/.cache/pagedserve/kernels``)
in a directory keyed by the source, the torch install, the target ISA (``$PAGEDSERVE_CPU_ISA``:
``native``, the default, ``avx2`` or ``avx512``) and the host CPU, so a rebuild happens only when
one of them changes; an flock makes concurrent first uses wait for one build.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from pagedserve.cache.attention.build import BASE_CFLAGS, build_extension, build_key
from pagedserve.cache.attention.cpu_features import host_cpu_flags
from pagedserve.cache.attention.metadata import AttentionMetadata
from pagedserve.cache.attention.torch_ref import TorchPagedAttention, to_cache_dtype

logger = logging.getLogger(__name__)

# One extension: the attention kernel, the fused ops of CPU models (norm, SiLU-and-mul, RoPE), the
# float32 decode-size linears (skinny, panel), the K/V store and greedy sampling's argmax.
_SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "bindings.cpp",
        "paged_attention.cpp",
        "rms_norm.cpp",
        "rope.cpp",
        "silu_mul.cpp",
        "skinny_linear.cpp",
        "panel_linear.cpp",
        "store_kv.cpp",
        "greedy.cpp",
    )
)
_HEADERS = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "amx_tiles.h",
        "aten_ops.h",
        "bfloat16_bits.h",
        "float_tiles.h",
        "float_vectors.h",
        "prefetch.h",
        "row_formats.h",
        "tile_attention.h",
        "transpose.h",
    )
)  # part of the build key too
ISA_ENV = "PAGEDSERVE_CPU_ISA"
# The ISA the kernel is compiled for: `native` is the host's own (-march=native); `avx2` and
# `avx512` build a fixed x86 level (tuned for the host), so a developer on an AVX-512 machine
# builds, tests and times the AVX2 path as well. The kernel picks its vector width from the
# level's macros (8 floats for AVX2, 16 for AVX-512).
# -mprefer-vector-width=512: GCC's tuning for Intel's server cores vectorises plain loops (the fused
# ops' rows) 256 bits wide on AVX-512; 512 made SiLU-and-multiply 1.2-1.45x and the RMSNorm
# 1.2-1.45x faster on Sapphire Rapids (benchmarks/RESULTS.md, "Thirtieth session"). The kernels
# written with explicit vector types are unaffected; on an AVX2 host the flag changes nothing.
ISA_FLAGS = {
    "native": ["-march=native", "-mprefer-vector-width=512"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],  # AVX2, FMA, F16C, BMI2
    # + AVX-512 F, BW, CD, DQ, VL
    "avx512": ["-march=x86-64-v4", "-mtune=native", "-mprefer-vector-width=512"],
}
# /proc/cpuinfo flags an ISA build needs from the host (native needs nothing beyond the host).
ISA_REQUIRED_FLAGS = {
    "native": (),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
# The kernel keeps a row in registers as kMaxChunks x 16 floats; larger heads take the reference.
MAX_HEAD_DIM = 512
KERNEL_QUERY_DTYPES = (torch.float32, torch.bfloat16)  # read in place; others widened first


def kernel_cache_dir() -> Path:
    """Root of the kernel build cache: ``$PAGEDSERVE_CACHE/kernels`` (default
    ``~/.cache/pagedserve/kernels``)."""
    root = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "kernels"


def requested_isa() -> str:
    """`$PAGEDSERVE_CPU_ISA` (default native), checked.

    Raises:
        ValueError: not one of the known ISA names.
    """
    isa = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r} is not one of {', '.join(ISA_FLAGS)}")
    return isa


def host_runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The ISA builds this host can execute (native always), from its /proc/cpuinfo flags."""
    flags = host_cpu_flags() if flags is None else flags
    return [isa for isa, needed in ISA_REQUIRED_FLAGS.items() if all(f in flags for f in needed)]


@functools.cache
def _check_isa(isa: str) -> None:
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown CPU ISA {isa!r}; expected one of {', '.join(ISA_FLAGS)}")
    if isa not in host_runnable_isas():
        missing = [f for f in ISA_REQUIRED_FLAGS[isa] if f not in host_cpu_flags()]
        raise RuntimeError(f"this CPU cannot run the {isa} kernel build (no {', '.join(missing)})")


def load_cpu_kernel(isa: str | None = None) -> ModuleType:
    """Build (first time) and import the C++ extension for `isa` (None: `requested_isa()`);
    cached per ISA for the process.

    Raises:
        ValueError: an unknown ISA name.
        RuntimeError: the host cannot execute that ISA, or the compiler or torch's build
            tooling failed (with the build log).
    """
    return _load_cpu_kernel(isa or requested_isa())


@functools.cache
def _load_cpu_kernel(isa: str) -> ModuleType:
    _check_isa(isa)
    cflags = [*BASE_CFLAGS, *ISA_FLAGS[isa]]
    key = build_key((*_SOURCES, *_HEADERS), isa, str(cflags))
    build_dir = kernel_cache_dir() / f"paged_attention_{isa}_{key}"
    if not (build_dir / f"pagedserve_paged_attention_{key}.so").exists():
        logger.info(
            "building the CPU attention kernel in %s (first use, under a minute)", build_dir
        )
    return build_extension(
        f"pagedserve_paged_attention_{key}", _SOURCES, cflags, build_dir, "the CPU attention kernel"
    )


class CpuPagedAttention:
    """Paged attention on CPU tensors via the C++ kernel.

    The kernel reads K/V in place through the block tables (no per-request gather), handles a
    mixed batch of decode tokens and prefill chunks in one call, and computes in float32 whatever
    the cache stores (float32, bfloat16, float16 or fp8 e4m3); queries of any float dtype.
    """

    name = "cpu"

    def __init__(self, isa: str | None = None) -> None:
        self.isa = isa or requested_isa()
        self._kernel = load_cpu_kernel(self.isa)
        self._reference: TorchPagedAttention | None = None  # for heads the kernel cannot take

    @property
    def kernel(self) -> ModuleType:
        """The C++ module: engine/direct_layer.py calls its store and attention itself where
        `store_kv` and `forward` would pass their arguments through unchanged."""
        return self._kernel

    def store_kv(
        self,
        key: Tensor,
        value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        # One C++ pass from the model's strided views into the slots (csrc/store_kv.cpp); K/V of
        # another dtype than the cache's (a bfloat16 or fp8 cache) are converted on the way.
        if key.dtype != key_cache.dtype:
            key, value = (
                to_cache_dtype(key, key_cache.dtype),
                to_cache_dtype(value, key_cache.dtype),
            )
        self._kernel.store_kv(key, value, key_cache, value_cache, slot_mapping)

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        if query.shape[-1] > MAX_HEAD_DIM:
            if self._reference is None:
                logger.warning(
                    "head_dim %d exceeds the CPU kernel's %d: using the slow torch reference",
                    query.shape[-1],
                    MAX_HEAD_DIM,
                )
                self._reference = TorchPagedAttention()
            options = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks)
            return self._reference.forward(query, key_cache, value_cache, meta, scale, **options)
        # The kernel computes in float32 whatever the cache holds. It reads float32 and bfloat16
        # queries in place (strided: HF's transposed view) and writes its output in their dtype.
        kernel_query = query if query.dtype in KERNEL_QUERY_DTYPES else query.float()
        if kernel_query.stride(-1) != 1:  # head_dim must be contiguous; other strides are free
            kernel_query = kernel_query.contiguous()
        output = self._kernel.paged_attention(
            kernel_query,  # [num_tokens, num_heads, head_dim]
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            None if sinks is None else sinks.float().contiguous(),
        )
        return output.to(query.dtype)  # a no-op but for float16 queries
