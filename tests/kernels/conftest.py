"""Shared fixtures for the attention kernel tests: random paged batches and the triton switch.

Without CUDA, triton kernels run under its interpreter; TRITON_INTERPRET must be set before
triton decorates them, i.e. before a triton backend is first built, which this module guarantees.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.cache.attention import AttentionMetadata  # noqa: E402

PagedBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]


def make_paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Random query and caches plus metadata for requests with the given chunk and context lengths.

    Block tables are a random permutation of the cache's blocks (non-contiguous, non-monotonic)
    and the cache has spare random blocks, so a kernel reading the wrong block gets a wrong answer.
    The caches hold `kv_dtype` (default: `dtype`, the query's).
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    permutation = torch.randperm(num_blocks, generator=generator).int()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    next_block = 0
    for request, num_req_blocks in enumerate(blocks_per_req):
        block_tables[request, :num_req_blocks] = permutation[
            next_block : next_block + num_req_blocks
        ]
        next_block += num_req_blocks
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(kv_dtype or dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(kv_dtype or dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),  # forward does not read it
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
    )
    return query.to(device), key_cache.to(device), value_cache.to(device), meta


# Max abs error against the float32-accumulating reference, per input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_matches_reference(
    backend, batch: PagedBatch, scale: float = 0.125, **options: object
) -> None:
    """Run `backend` and the torch reference on one batch; fail with the error if out of tolerance.

    `options` are the per-layer keyword options (sliding_window, softcap, sinks), given to both.
    """
    from pagedserve.cache.attention import TorchPagedAttention

    query, key_cache, value_cache, meta = batch
    actual = backend.forward(query, key_cache, value_cache, meta, scale, **options)
    expected = TorchPagedAttention().forward(query, key_cache, value_cache, meta, scale, **options)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE[query.dtype], f"max abs error {error:.3g} for {query.dtype}"


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """Factory: ``paged_batch(query_lens, seq_lens, num_heads=..., ...)``, see make_paged_batch."""
    return make_paged_batch


@pytest.fixture
def matches_reference() -> Callable[..., None]:
    """``matches_reference(backend, batch)`` asserts the backend agrees with the reference."""
    return assert_matches_reference


def _runnable_isas() -> list[str]:
    from pagedserve.cache.attention.cpu import host_runnable_isas

    return host_runnable_isas()


@pytest.fixture(scope="session", params=_runnable_isas())
def cpu_backend(request):
    """The C++ backend once per ISA build this host can execute (native, and avx2 / avx512 where
    the CPU has them), each built once per session (the first build takes a minute or more)."""
    from pagedserve.cache.attention.cpu import CpuPagedAttention

    return CpuPagedAttention(isa=request.param)
