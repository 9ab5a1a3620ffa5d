"""Readable paged attention in plain torch: the definition of correct for every other backend.

Per request it gathers K/V through the block table into a contiguous copy and runs a masked
float32 softmax. Slow by design (a Python loop and a copy per request per layer); tests compare
the fast backends against it, and it is the warned fallback when no fast backend can serve.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.cache.attention.metadata import AttentionMetadata


def to_cache_dtype(values: Tensor, dtype: torch.dtype) -> Tensor:
    """New K or V rows in the cache's storage dtype, contiguous; fp8 saturates at its largest
    finite value (448 for e4m3) rather than overflowing to NaN."""
    if dtype.itemsize == 1:  # fp8
        largest = torch.finfo(dtype).max
        values = values.clamp(-largest, largest)
    return values.to(dtype).contiguous()


def store_kv_by_slot(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write token i's K/V into flat slot ``slot_mapping[i]`` of the caches, in place."""
    for new, cache in ((key, key_cache), (value, value_cache)):
        # As bytes: CPU index_copy_ has no fp8 kernel, and a row copy is dtype-blind anyway.
        # NOTE: view(), not reshape(): a copy would silently drop the write.
        rows = cache.view(-1, cache.shape[2], cache.shape[3]).view(torch.uint8)
        rows.index_copy_(0, slot_mapping, to_cache_dtype(new, cache.dtype).view(torch.uint8))


def gather_request_kv(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """Copy positions ``0..seq_len-1`` of one request out of a paged cache.

    Returns [seq_len, num_kv_heads, head_dim].
    """
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)  # [seq_len]
    blocks = block_table[positions // block_size].long()  # [seq_len]
    slots = blocks * block_size + positions % block_size  # [seq_len]
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


class TorchPagedAttention:
    """Reference backend: gather + causal masked softmax in float32, one request at a time."""

    name = "torch"

    def store_kv(
        self,
        key: Tensor,
        value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        store_kv_by_slot(key, value, key_cache, value_cache, slot_mapping)

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        group_size = num_heads // num_kv_heads
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        query_start_loc = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            q_len = end - start
            table = meta.block_tables[i]
            # Reference only: expanding K/V per query head keeps the math obvious.
            k = gather_request_kv(key_cache, table, seq_len).float()  # [seq_len, kv_heads, D]
            v = gather_request_kv(value_cache, table, seq_len).float()
            k = k.repeat_interleave(group_size, dim=1)  # [seq_len, num_heads, D]
            v = v.repeat_interleave(group_size, dim=1)
            q = query[start:end].float()  # [q_len, num_heads, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
            query_positions = torch.arange(seq_len - q_len, seq_len, device=query.device)
            key_positions = torch.arange(seq_len, device=query.device)
            is_future = key_positions[None, :] > query_positions[:, None]  # [q_len, seq_len]
            scores = scores.masked_fill(is_future, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            output[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return output
