"""Triton paged attention backend (CUDA; CPU tensors only under ``TRITON_INTERPRET=1``).

Triton is imported lazily (``triton_kernels`` at construction), so the package imports and the
other backends work on machines without triton.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from pagedserve.cache.attention.metadata import AttentionMetadata
from pagedserve.cache.attention.torch_ref import to_cache_dtype

_BLOCK_N = 32  # key positions per step: [BLOCK_M, 32] scores stay in registers
_MIN_BLOCK_M = 16  # tl.dot needs >= 16 rows on GPUs


def _load_kernels() -> ModuleType:
    try:
        from pagedserve.cache.attention import triton_kernels
    except ImportError as error:
        raise RuntimeError(f"the triton attention backend needs triton: {error}") from error
    return triton_kernels


class TritonPagedAttention:
    """Paged attention and K/V store as Triton kernels; one launch serves a mixed batch.

    Grid: (request, kv head, query tile); each program covers TOKENS_PER_TILE tokens times the
    kv head's GROUP_SIZE query heads, so GQA shares each K/V load across its query heads.
    """

    name = "triton"

    def __init__(self) -> None:
        self._kernels = _load_kernels()

    def store_kv(
        self,
        key: Tensor,
        value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        num_tokens = key.shape[0]
        # Converted (and for fp8 saturated) by torch; the kernel copies bytes, so it needs no fp8
        # support of its own.
        key = to_cache_dtype(key, key_cache.dtype).view(torch.uint8)
        value = to_cache_dtype(value, value_cache.dtype).view(torch.uint8)
        row_size = key.shape[1] * key.shape[2]  # bytes: num_kv_heads * head_dim * itemsize
        block = min(1024, 1 << (row_size - 1).bit_length())
        grid = (num_tokens, -(-row_size // block))
        self._kernels.store_kv_kernel[grid](
            key,
            value,
            key_cache.view(torch.uint8),
            value_cache.view(torch.uint8),
            slot_mapping,
            row_size,
            BLOCK=block,
        )

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
        """Causal paged attention; the keyword options as in the torch reference."""
        query = query.contiguous()  # [num_tokens, num_heads, head_dim]
        output = torch.empty_like(query)
        constants = _compile_time_args(query, key_cache.shape[2], sliding_window, softcap, sinks)
        # An unused pointer argument still needs a tensor: the query stands in for absent sinks.
        sinks_arg = sinks.float().contiguous() if sinks is not None else query
        num_tiles = -(-meta.max_query_len // constants["TOKENS_PER_TILE"])
        self._kernels.paged_attention_kernel[(meta.num_reqs, key_cache.shape[2], num_tiles)](
            output,
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            sinks_arg,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            meta.block_tables.shape[1],
            key_cache.shape[1],
            **constants,
        )
        return output


def _compile_time_args(
    query: Tensor,
    num_kv_heads: int,
    sliding_window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> dict[str, object]:
    """The kernel's constexpr arguments: shapes, the query tile, and which options are on."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group_size = num_heads // num_kv_heads
    block_m = max(_MIN_BLOCK_M, 1 << (group_size - 1).bit_length())
    return dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        GROUP_SIZE=group_size,
        TOKENS_PER_TILE=block_m // group_size,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
        DOT_FP32=query.dtype == torch.float32 or query.device.type == "cpu",
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
    )
