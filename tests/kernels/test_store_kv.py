"""store_kv writes each new token's K/V to exactly the slot the slot mapping names."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cache.attention import get_attention_backend

BACKENDS = ["torch", "cpu", "triton"]


def backend_on_its_device(backend_name: str):
    """The backend and the device its caches live on: triton on CUDA, else under the interpreter."""
    device = "cpu"
    if backend_name == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return get_attention_backend(backend_name, torch.device(device)), device


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_exactly_the_named_slots(backend_name, dtype):
    backend, device = backend_on_its_device(backend_name)
    num_blocks, block_size, num_kv_heads, head_dim = 4, 5, 3, 8
    generator = torch.Generator().manual_seed(0)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
        dtype
    )
    value_cache = torch.randn(key_cache.shape, generator=generator).to(dtype)
    key_before, value_before = key_cache.clone(), value_cache.clone()
    slot_mapping = torch.tensor([13, 0, 19, 7, 8])  # unordered, crossing blocks, incl. first/last
    key = torch.randn(5, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(5, num_kv_heads, head_dim, generator=generator).to(dtype)

    on_device = [t.to(device) for t in (key, value, key_cache, value_cache, slot_mapping)]
    backend.store_kv(*on_device)
    key_cache, value_cache = on_device[2].cpu(), on_device[3].cpu()

    for cache, before, new in ((key_cache, key_before, key), (value_cache, value_before, value)):
        flat, flat_before = (
            cache.view(-1, num_kv_heads, head_dim),
            before.view(-1, num_kv_heads, head_dim),
        )
        assert torch.equal(flat[slot_mapping], new)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slot_mapping] = False
        assert torch.equal(flat[untouched], flat_before[untouched])


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_store_kv_converts_to_the_cache_dtype_and_fp8_saturates(backend_name, kv_dtype):
    # `--kv-cache-dtype`: float32 K/V into a smaller cache. fp8 e4m3 has no infinity; values past
    # its largest finite 448 must saturate, not become NaN.
    backend, device = backend_on_its_device(backend_name)
    key_cache = torch.zeros(2, 4, 1, 4, dtype=kv_dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    key = torch.tensor([[[1000.0, -1000.0, 0.3, -2.5]], [[1.0, 2.0, 3.0, 4.0]]], device=device)
    value = -key
    slot_mapping = torch.tensor([6, 1], device=device)
    backend.store_kv(key, value, key_cache, value_cache, slot_mapping)

    largest = torch.finfo(kv_dtype).max
    expected_key = key.clamp(-largest, largest).to(kv_dtype).float()
    stored_key = key_cache.view(-1, 1, 4)[slot_mapping].float()
    stored_value = value_cache.view(-1, 1, 4)[slot_mapping].float()
    assert torch.equal(stored_key, expected_key)
    assert torch.equal(stored_value, -expected_key)
    if kv_dtype == torch.float8_e4m3fn:
        assert stored_key[0, 0, :2].tolist() == [448.0, -448.0]
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[slot_mapping.cpu()] = False
    assert not key_cache.view(-1, 4)[untouched.to(device)].float().any()
