"""`--kv-cache-dtype`: the default float32 model over a bfloat16 or fp8 (e4m3) KV cache.

A smaller cache dtype changes the numbers attention reads, so the reference is Hugging Face
`generate` whose attention rounds K/V to that dtype exactly as the cache stores them (fp8:
saturated at +-448) and then runs sdpa in float32: the engine must equal it token for token (up
to a documented near-tie). The plain float32 reference would be the wrong oracle for fp8, whose
3-bit mantissa changes greedy output within tens of tokens on this 135M model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pagedserve.cache.attention.torch_ref import to_cache_dtype
from pagedserve.cache.cache_engine import KV_CACHE_DTYPES
from tests.engine.conftest import (
    add_requests,
    assert_matches_reference,
    greedy_params,
    hf_greedy_reference,
    make_engine,
    run_to_completion,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_NEW_TOKENS = 32
PROMPTS = [
    "In 1969, Apollo 11",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n",
    "The three laws of thermodynamics are",
]


def _rounded_kv_sdpa(kv_dtype: torch.dtype):
    """sdpa over K/V rounded through `kv_dtype`: what attention sees from such a cache."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        key = to_cache_dtype(key, kv_dtype).to(query.dtype)
        value = to_cache_dtype(value, kv_dtype).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_greedy_output_equals_hf_with_kv_rounded_to_the_cache_dtype(default_loaded, kv_cache_dtype):
    kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    implementation = f"pagedserve_test_rounded_kv_{kv_cache_dtype}"
    AttentionInterface.register(implementation, _rounded_kv_sdpa(kv_dtype))
    prompts = {f"p{i}": default_loaded.tokenizer.encode(text) for i, text in enumerate(PROMPTS)}
    references = {
        request_id: hf_greedy_reference(
            default_loaded.model, prompt, MAX_NEW_TOKENS, attn_implementation=implementation
        )
        for request_id, prompt in prompts.items()
    }

    engine = make_engine(default_loaded, kv_cache_dtype=kv_cache_dtype, block_size=16)
    assert engine.cache_engine.spec.dtype == kv_cache_dtype
    assert all(cache.dtype == kv_dtype for cache in engine.cache_engine.key_caches)
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)

    for request_id, reference in references.items():
        assert_matches_reference(
            run.token_ids[request_id], reference, f"{kv_cache_dtype} {request_id}"
        )


def test_fp8_cache_holds_four_times_the_tokens_of_float32_in_one_budget(default_loaded):
    budget = {"kv_cache_memory": "64MiB"}
    float32 = make_engine(default_loaded, kv_cache_dtype="auto", num_kv_blocks=None, **budget)
    fp8 = make_engine(default_loaded, kv_cache_dtype="fp8", num_kv_blocks=None, **budget)
    assert float32.cache_engine.spec.dtype == "float32"  # auto: the weights' dtype
    assert fp8.cache_engine.spec.dtype == "fp8_e4m3"  # "fp8" is short for e4m3
    assert fp8.cache_engine.num_blocks == 4 * float32.cache_engine.num_blocks
