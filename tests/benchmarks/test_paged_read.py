"""The paged roofline's read pass (benchmarks/paged_read.py): it reads exactly the blocks a step's
requests hold, K and V, through their tables, and refuses tables that leave the cache."""

from __future__ import annotations

import pytest
import torch

from pagedserve.benchmarks.paged_read import read_paged_kv


def _expected(key_cache, value_cache, tables, seq_lens, block_size) -> int:
    """The largest int32 in the blocks each request's table reaches up to its seq_len."""
    reached = [
        int(block)
        for table, seq_len in zip(tables.tolist(), seq_lens.tolist(), strict=True)
        for block in table[: -(-seq_len // block_size)]
    ]
    flat = torch.cat(
        [cache.view(torch.int32)[reached].flatten() for cache in (key_cache, value_cache)]
    )
    return int(flat.max())


@pytest.mark.parametrize(
    "into_l1, blocks_at_once",  # neither the prefetch hint nor the read order changes the result
    [(False, 1), (True, 1), (False, 2), (False, 4)],  # 4: whole groups and a shorter rest
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_reads_every_block_the_tables_reach_and_no_other(dtype, seed, into_l1, blocks_at_once):
    generator = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv_heads, head_dim = 24, 16, 3, 64
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))

    def read(tables, seq_lens):
        return read_paged_kv(key_cache, value_cache, tables, seq_lens, into_l1, blocks_at_once)

    tables = torch.randperm(num_blocks, generator=generator)[:20].view(4, 5).int()
    seq_lens = torch.randint(1, 5 * block_size + 1, (4,), generator=generator).int()
    assert read(tables, seq_lens) == _expected(key_cache, value_cache, tables, seq_lens, block_size)
    # The largest value anywhere, put in a block no table reaches, is not read...
    unread = sorted(set(range(num_blocks)) - set(tables[:, :1].flatten().tolist()))[0]
    short = torch.ones(4, dtype=torch.int32)  # one token: each request's first block only
    largest = torch.iinfo(torch.int32).max
    value_cache.view(torch.int32)[unread, 2, 1, 7] = largest
    assert read(tables, short) < largest
    # ...and is, once a table reaches it (in V: both caches are read).
    tables[2, 0] = unread
    assert read(tables, short) == largest


def test_refuses_tables_that_leave_the_cache():
    key_cache = torch.zeros(4, 16, 1, 64)
    value_cache = torch.zeros_like(key_cache)
    one_token = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not in the cache"):
        read_paged_kv(key_cache, value_cache, torch.tensor([[4]], dtype=torch.int32), one_token)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        read_paged_kv(
            key_cache, value_cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([17]).int()
        )
    for blocks_at_once in (0, 3, 16):
        with pytest.raises(RuntimeError, match="blocks_at_once"):
            read_paged_kv(
                key_cache, value_cache, torch.tensor([[0]]).int(), one_token, False, blocks_at_once
            )
    with pytest.raises(RuntimeError, match="one shape"):
        read_paged_kv(key_cache, value_cache[:2], torch.tensor([[0]], dtype=torch.int32), one_token)
