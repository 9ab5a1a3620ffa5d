"""store_kv writes each new token's K/V to exactly the slot the slot mapping names."""

from __future__ import annotations

import pytest
import torch

from cache.attention import get_attention_backend

BACKENDS = ["torch", "cpu", "triton"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_exactly_the_named_slots(backend_name, dtype):
    device = "cpu"
    if backend_name == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under the interpreter
    backend = get_attention_backend(backend_name, torch.device(device))
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
