"""CacheEngine: the KV tensors a CacheSpec describes, and block copies across every layer."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cache.cache_engine import KV_CACHE_DTYPES, CacheEngine
from pagedserve.cache.cache_spec import CacheSpec


def make_spec(dtype: str) -> CacheSpec:
    return CacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, dtype=dtype, block_size=4)


@pytest.mark.parametrize(
    ("dtype", "bytes_per_value"), [("float32", 4), ("bfloat16", 2), ("float16", 2), ("fp8_e4m3", 1)]
)
def test_block_bytes_follow_the_storage_dtype(dtype, bytes_per_value):
    spec = make_spec(dtype)
    # K and V, per layer, per kv head, per dim, per slot
    assert spec.bytes_per_block == 2 * 2 * 3 * 8 * 4 * bytes_per_value
    engine = CacheEngine(spec, num_blocks=5, device="cpu")
    assert engine.num_bytes == 5 * spec.bytes_per_block
    for cache in (*engine.key_caches, *engine.value_caches):
        assert cache.shape == (5, 4, 3, 8) and cache.dtype == KV_CACHE_DTYPES[dtype]
        assert cache.untyped_storage().nbytes() * 2 * 2 == spec.bytes_per_block * 5


def test_a_smaller_dtype_buys_proportionally_more_blocks_from_one_budget():
    budget = 100 * make_spec("float32").bytes_per_block
    blocks = {dtype: make_spec(dtype).num_blocks_for_budget(budget) for dtype in KV_CACHE_DTYPES}
    assert (blocks["float32"], blocks["bfloat16"], blocks["fp8_e4m3"]) == (100, 200, 400)


@pytest.mark.parametrize("dtype", sorted(KV_CACHE_DTYPES))
def test_copy_blocks_copies_each_source_to_its_destination_in_every_layer(dtype):
    engine = CacheEngine(make_spec(dtype), num_blocks=4, device="cpu")
    generator = torch.Generator().manual_seed(0)
    for cache in (*engine.key_caches, *engine.value_caches):
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    before = [cache.clone() for cache in (*engine.key_caches, *engine.value_caches)]

    engine.copy_blocks([(0, 2), (3, 1)])

    for cache, old in zip((*engine.key_caches, *engine.value_caches), before, strict=True):
        as_bytes, old_bytes = cache.view(torch.uint8), old.view(torch.uint8)
        assert torch.equal(as_bytes[2], old_bytes[0]) and torch.equal(as_bytes[1], old_bytes[3])
        assert torch.equal(as_bytes[0], old_bytes[0]) and torch.equal(as_bytes[3], old_bytes[3])


def test_an_unknown_storage_dtype_is_rejected():
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        make_spec("int4")
