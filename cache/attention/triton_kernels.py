"""Triton kernels for the paged KV cache: store K/V by slot mapping, and paged attention.

Imported only by ``triton_backend`` when a triton backend is built, so ``cache.attention`` imports
without triton. Kernels run on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    key_ptr,  # [num_tokens, row_size] bytes, already in the cache's dtype
    value_ptr,  # [num_tokens, row_size] bytes
    key_cache_ptr,  # [num_slots, row_size] bytes
    value_cache_ptr,  # [num_slots, row_size] bytes
    slot_mapping_ptr,  # [num_tokens] int64
    row_size,  # bytes of one slot: num_kv_heads * head_dim * itemsize
    BLOCK: tl.constexpr,
):
    """One program per (token, chunk of its row): copy its K and V row to its slot."""
    token = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < row_size
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    source = token.to(tl.int64) * row_size + offsets
    target = slot * row_size + offsets
    tl.store(key_cache_ptr + target, tl.load(key_ptr + source, mask=mask), mask=mask)
    tl.store(value_cache_ptr + target, tl.load(value_ptr + source, mask=mask), mask=mask)


@triton.jit
def paged_attention_kernel(
    output_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_num_blocks_per_req] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    sinks_ptr,  # [num_heads] float32 (read only when HAS_SINKS)
    scale,
    sliding_window,  # keys in (p - sliding_window, p] (read only when HAS_WINDOW)
    softcap,  # scores -> softcap * tanh(scores / softcap) (read only when HAS_SOFTCAP)
    max_num_blocks_per_req,
    block_size,
    num_heads: tl.constexpr,
    num_kv_heads: tl.constexpr,
    head_dim: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # num_heads // num_kv_heads
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP_SIZE query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: TOKENS_PER_TILE * GROUP_SIZE, padded to 2^k
    BLOCK_N: tl.constexpr,  # key positions per loop step
    BLOCK_D: tl.constexpr,  # head_dim padded to 2^k
    DOT_FP32: tl.constexpr,  # float32 inputs, or the interpreter (its bf16 tl.dot is wrong)
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program (request, kv head, query tile): rows = tile tokens x the kv head's query heads.

    Keys are visited BLOCK_N positions at a time, each resolved through the block table, with an
    online softmax (base 2), so K/V are read once per kv head group and never gathered. With a
    sliding window the loop starts at the tile's oldest visible key; a sink starts each row's
    softmax as if one key of logit ``sinks[head]`` (and value 0) had been seen.
    """
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    tile_start = tl.program_id(2) * TOKENS_PER_TILE
    if tile_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    first_position = seq_len - query_len  # position of the chunk's row 0

    rows = tl.arange(0, BLOCK_M)
    token_in_chunk = tile_start + rows // GROUP_SIZE  # [BLOCK_M]
    head = kv_head * GROUP_SIZE + rows % GROUP_SIZE  # [BLOCK_M]
    row_mask = (rows < TOKENS_PER_TILE * GROUP_SIZE) & (token_in_chunk < query_len)
    row_position = first_position + token_in_chunk  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    query_offsets = ((query_start + token_in_chunk).to(tl.int64) * num_heads + head) * head_dim
    q = tl.load(
        query_ptr + query_offsets[:, None] + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    log2e = 1.4426950408889634  # exp2 below
    qk_scale = scale * log2e
    # Finite start (not -inf) so fully masked padding rows never compute inf - inf.
    row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        row_max = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * log2e
        row_sum = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # exp2(sink - row_max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    num_keys = tl.minimum(seq_len, first_position + tile_start + TOKENS_PER_TILE)
    table = block_tables_ptr + request.to(tl.int64) * max_num_blocks_per_req
    first_key = 0
    if HAS_WINDOW:  # older keys are outside every row's window: never loaded (may be freed)
        first_key = tl.maximum(first_position + tile_start - sliding_window + 1, 0)
    for key_begin in range((first_key // BLOCK_N) * BLOCK_N, num_keys, BLOCK_N):
        positions = key_begin + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_mask = (positions < num_keys) & (positions >= first_key)
        block = tl.load(table + positions // block_size, mask=key_mask, other=0).to(tl.int64)
        slot = block * block_size + positions % block_size
        kv_offsets = (slot * num_kv_heads + kv_head) * head_dim  # [BLOCK_N]
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:  # "ieee": tf32 would cost ~1e-3 accuracy against the float32 reference
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # the cache may store another dtype (e.g. fp8): compute in the query's
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            scores = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly at +-1
            capped = scores * (scale / softcap)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * log2e
        else:
            scores = scores * qk_scale  # [BLOCK_M, BLOCK_N]
        is_visible = key_mask[None, :] & (positions[None, :] <= row_position[:, None])
        if HAS_WINDOW:
            is_visible &= positions[None, :] > row_position[:, None] - sliding_window
        scores = tl.where(is_visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(row_max - new_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        if DOT_FP32:
            pv = tl.dot(probs, v.to(tl.float32), input_precision="ieee")
            acc = acc * correction[:, None] + pv
        else:
            acc = acc * correction[:, None] + tl.dot(probs.to(q.dtype), v)
        row_max = new_max

    row_sum = tl.where(row_sum > 0, row_sum, 1.0)  # padding rows: avoid 0/0, never stored
    out = acc / row_sum[:, None]
    tl.store(
        output_ptr + query_offsets[:, None] + dims[None, :],
        out.to(output_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
