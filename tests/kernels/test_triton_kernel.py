"""The Triton kernels agree with the torch reference (on CPU under TRITON_INTERPRET=1, tiny shapes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; triton backend tests skipped")

from pagedserve.cache.attention import get_attention_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu runs under the interpreter

# Decode with context, prefill without prefix, first token, chunk after a cached prefix.
QUERY_LENS = [1, 5, 1, 6]
SEQ_LENS = [19, 5, 1, 27]


@pytest.fixture(scope="module")
def triton_backend():
    return get_attention_backend("triton", torch.device(DEVICE))


# A covering subset of (block size, head dim, GQA ratio, dtype); the interpreter is slow.
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group_size", "dtype"),
    [
        (1, 64, 1, torch.float32),
        (5, 128, 3, torch.float32),
        (16, 64, 8, torch.float32),
        (32, 64, 3, torch.float32),
        (5, 64, 1, torch.bfloat16),
        (16, 128, 8, torch.bfloat16),
        (32, 64, 3, torch.bfloat16),
    ],
)
def test_triton_kernel_matches_reference_on_mixed_batch(
    triton_backend, paged_batch, matches_reference, block_size, head_dim, group_size, dtype
):
    batch = paged_batch(
        QUERY_LENS,
        SEQ_LENS,
        num_heads=2 * group_size,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        seed=block_size,
    )
    matches_reference(triton_backend, batch)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e4m3fn),
    ],
)
def test_triton_kernel_reads_a_cache_stored_in_a_smaller_dtype(
    triton_backend, paged_batch, matches_reference, dtype, kv_dtype
):
    batch = paged_batch(
        QUERY_LENS,
        SEQ_LENS,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=5,
        dtype=dtype,
        kv_dtype=kv_dtype,
        device=DEVICE,
    )
    matches_reference(triton_backend, batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernel_matches_reference_at_model_shapes_on_gpu(
    triton_backend, paged_batch, matches_reference, dtype
):
    batch = paged_batch(
        [1] * 30 + [200, 77],
        [1024] * 30 + [700, 77],
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device="cuda",
    )
    matches_reference(triton_backend, batch)
