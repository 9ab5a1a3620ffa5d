"""The torch reference is the definition of correct, so it is itself checked by hand and by SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.cache.attention import AttentionMetadata, TorchPagedAttention


def _metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor
) -> AttentionMetadata:
    query_start_loc = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(query_lens),
    )


def test_reference_averages_visible_values_when_queries_are_zero():
    # Zero queries give uniform weights: row j must be the mean of values 0..j (hand-checkable).
    values = torch.tensor([[2.0, 0.0], [0.0, 4.0], [4.0, 8.0]])  # [3 positions, head_dim 2]
    value_cache = torch.zeros(2, 2, 1, 2)  # [num_blocks 2, block_size 2, kv_heads 1, head_dim 2]
    # Block table [1, 0]: positions 0, 1 live in block 1, position 2 in block 0.
    value_cache[1, 0, 0], value_cache[1, 1, 0], value_cache[0, 0, 0] = values
    key_cache = torch.randn_like(value_cache)
    meta = _metadata([3], [3], torch.tensor([[1, 0]], dtype=torch.int32))
    output = TorchPagedAttention().forward(torch.zeros(3, 1, 2), key_cache, value_cache, meta, 1.0)
    expected = torch.tensor([[2.0, 0.0], [1.0, 2.0], [2.0, 4.0]])
    torch.testing.assert_close(output[:, 0], expected)


def test_reference_matches_causal_sdpa_on_contiguous_layout():
    num_heads, num_kv_heads, head_dim, block_size, seq_len = 6, 2, 16, 4, 11
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(seq_len, num_heads, head_dim, generator=generator)
    num_blocks = -(-seq_len // block_size)
    padded = num_blocks * block_size
    key_cache = torch.zeros(padded, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    key_cache[:seq_len], value_cache[:seq_len] = key, value
    identity_table = torch.arange(num_blocks, dtype=torch.int32)[None]  # contiguous layout
    meta = _metadata([seq_len], [seq_len], identity_table)
    output = TorchPagedAttention().forward(
        query,
        key_cache.view(num_blocks, block_size, num_kv_heads, head_dim),
        value_cache.view(num_blocks, block_size, num_kv_heads, head_dim),
        meta,
        head_dim**-0.5,
    )
    group = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(
        query.transpose(0, 1),  # [num_heads, seq_len, head_dim]
        key.repeat_interleave(group, 1).transpose(0, 1),
        value.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_reference_chunked_prefill_equals_whole_prefill(paged_batch):
    # The same 24-token prompt: once whole, once as a 16-token cached prefix plus an 8-token chunk
    # plus the decode of its last token; the rows for the same positions must agree.
    query, key_cache, value_cache, meta = paged_batch(
        [24], [24], num_heads=4, num_kv_heads=2, head_dim=8, block_size=5
    )
    reference = TorchPagedAttention()
    whole = reference.forward(query, key_cache, value_cache, meta, 0.3)
    chunked_meta = _metadata([8, 1], [24, 24], meta.block_tables.repeat(2, 1))
    chunked_query = torch.cat([query[16:], query[23:]])
    chunked = reference.forward(chunked_query, key_cache, value_cache, chunked_meta, 0.3)
    torch.testing.assert_close(chunked[:8], whole[16:])
    torch.testing.assert_close(chunked[8], whole[23])
