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


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_store_kv_reads_the_models_strided_view(backend_name):
    # The model's K/V arrive as [tokens, kv_heads, head_dim] views of its [kv_heads, tokens,
    # head_dim] tensors: every backend must read them through their strides.
    backend, device = backend_on_its_device(backend_name)
    generator = torch.Generator().manual_seed(1)
    key_cache = torch.zeros(3, 4, 2, 8, device=device)
    value_cache = torch.zeros_like(key_cache)
    heads_first = torch.randn(2, 2, 5, 8, generator=generator).to(device)  # [K|V, heads, tokens, d]
    key, value = heads_first[0].transpose(0, 1), heads_first[1].transpose(0, 1)
    assert not key.is_contiguous()
    slot_mapping = torch.tensor([11, 2, 5, 0, 7], device=device)
    backend.store_kv(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache.view(-1, 2, 8)[slot_mapping], key)
    assert torch.equal(value_cache.view(-1, 2, 8)[slot_mapping], value)


def test_the_cpu_store_refuses_a_slot_outside_the_cache_and_writes_nothing(cpu_backend):
    key_cache = torch.zeros(2, 4, 1, 8)
    value_cache = torch.zeros_like(key_cache)
    rows = torch.ones(3, 1, 8)
    for bad_slot in (8, -1):
        slot_mapping = torch.tensor([0, bad_slot, 5])
        with pytest.raises(RuntimeError, match="outside the cache's 8 slots"):
            cpu_backend.store_kv(rows, rows, key_cache, value_cache, slot_mapping)
        assert not key_cache.any() and not value_cache.any()  # checked before any write


def test_the_cpu_store_kernel_checks_shapes_and_dtypes(cpu_backend):
    kernel = cpu_backend._kernel
    key_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slot_mapping = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="convert first"):  # the backend converts, the op not
        kernel.store_kv(
            torch.ones(2, 1, 8), torch.ones(2, 1, 8), key_cache, value_cache, slot_mapping
        )
    rows = torch.ones(2, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        kernel.store_kv(rows, rows, key_cache, value_cache, slot_mapping)
    rows = torch.ones(2, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.store_kv(rows, rows, key_cache, value_cache, slot_mapping.int())
