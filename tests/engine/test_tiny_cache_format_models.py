"""Greedy equality with HF `generate` (eager attention) for families with per-layer cache formats:
Gemma 2 (soft-capping, alternating sliding/full layers), Gemma 3 (5 sliding : 1 global), Mistral
with `sliding_window`, Qwen2 with `use_sliding_window`, GPT-OSS (sinks, alternating layers) and
DeepSeek-V2 (multi-head latent attention over a paged latent cache).
Prompts are longer than the window; block sizes 1 and 16, chunked prefill, and preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.cache.cache_spec import CacheSpec
from pagedserve.engine.memory import make_cache_spec
from pagedserve.engine.model_loader import LoadedModel
from tests.engine.conftest import (
    TINY_MAX_MODEL_LEN,
    TINY_VOCAB_SIZE,
    add_requests,
    assert_matches_reference,
    greedy_params,
    hf_greedy_reference,
    make_engine,
    run_to_completion,
)

WINDOW = 8
_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=TINY_MAX_MODEL_LEN,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            num_hidden_layers=4,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            **_COMMON,
        )
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=16, **_COMMON
        )
    ),
    "mistral-sliding": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **_COMMON)
    ),
    "qwen2-sliding": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=2,
            **_COMMON,
        )
    ),
    "deepseek-v2-mla": lambda: transformers.DeepseekV2ForCausalLM(
        transformers.DeepseekV2Config(
            **{**_COMMON, "num_key_value_heads": 4},
            moe_intermediate_size=32,
            num_hidden_layers=2,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=2,
            num_experts_per_tok=1,
            first_k_dense_replace=1,
        )
    ),
    "gpt-oss-sinks": lambda: transformers.GptOssForCausalLM(
        transformers.GptOssConfig(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["sliding_attention", "full_attention"],
            **_COMMON,
        )
    ),
}
PROMPT_LENGTHS = [3, 9, 17, 40]
MAX_NEW_TOKENS = 12


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {f"p{n}": [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, default_tokenizer):
    torch.manual_seed(0)
    model = FAMILIES[request.param]().float().eval()
    if request.param == "gpt-oss-sinks":  # initialised to zero: make the sinks matter
        for layer in model.model.layers:
            layer.self_attn.sinks.data.uniform_(-1.0, 2.0)
    loaded = LoadedModel(model, default_tokenizer, model.config, Path("."), TINY_MAX_MODEL_LEN)
    references = {
        rid: hf_greedy_reference(model, prompt, MAX_NEW_TOKENS, attn_implementation="eager")
        for rid, prompt in _prompts().items()
    }
    return request.param, loaded, references


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens"),
    [(1, 16), (16, 24), (16, 2048)],
    ids=["bs1-chunk16", "bs16-chunk24", "bs16-unchunked"],
)
def test_windowed_model_greedy_output_equals_hf_generate(
    family_case, block_size, max_num_batched_tokens
):
    family, loaded, references = family_case
    engine = make_engine(
        loaded,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=2048 // block_size,
    )
    add_requests(engine, _prompts(), greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    for request_id, reference in references.items():
        assert_matches_reference(
            run.token_ids[request_id], reference, f"{family} bs={block_size} {request_id}"
        )
    engine.block_manager.check_invariants()
    assert engine.block_manager.pool.usage == 0.0


def test_windowed_model_greedy_output_equals_hf_generate_under_preemption(family_case):
    family, loaded, references = family_case
    spec = make_cache_spec(loaded.hf_config, loaded.model, block_size=4)
    # The longest request fits alone, all four together do not.
    num_blocks = spec.num_blocks_per_request(max(PROMPT_LENGTHS) + MAX_NEW_TOKENS, 16)
    engine = make_engine(loaded, block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=16)
    add_requests(engine, _prompts(), greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    for request_id, reference in references.items():
        assert_matches_reference(
            run.token_ids[request_id], reference, f"{family} preempted {request_id}"
        )


def test_latent_attention_caches_the_latent_not_per_head_keys_and_values():
    torch.manual_seed(0)
    model = FAMILIES["deepseek-v2-mla"]().float().eval()
    spec = make_cache_spec(model.config, model, block_size=16)
    # kv_lora_rank 16 + qk_rope_head_dim 8, one vector (no V), float32, 2 layers, 16 tokens.
    assert spec.latent and (spec.num_kv_heads, spec.head_dim) == (1, 24)
    assert spec.bytes_per_block == 2 * 24 * 4 * 16
    # Per-head K and V (4 heads of 16 dims) would cost 128 values per token and layer, not 24.
    per_head = CacheSpec(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float32", block_size=16)
    assert per_head.bytes_per_block * 24 == spec.bytes_per_block * 128


def test_sliding_window_families_get_a_group_per_attention_kind():
    expected = {
        "gemma2": "2 full + 2 sliding(8)",
        "gemma3": "1 full + 1 sliding(8) + 1 sliding(8) + 1 sliding(8) + 1 sliding(8) + 1 sliding(8)",
        "mistral-sliding": "2 sliding(8)",
        "qwen2-sliding": "2 full + 2 sliding(8)",
        "gpt-oss-sinks": "1 full + 1 sliding(8)",
    }
    for family, groups in expected.items():
        torch.manual_seed(0)
        model = FAMILIES[family]().float().eval()
        assert make_cache_spec(model.config, model, block_size=4).describe_groups() == groups


def test_a_long_gemma2_request_holds_a_bounded_window_group_and_matches_hf(default_tokenizer):
    torch.manual_seed(0)
    model = FAMILIES["gemma2"]().float().eval()
    loaded = LoadedModel(model, default_tokenizer, model.config, Path("."), TINY_MAX_MODEL_LEN)
    prompt = _prompts()["p9"]
    num_new = 8 * WINDOW - len(prompt)  # the request grows to 8x the window
    reference = hf_greedy_reference(model, prompt, num_new, attn_implementation="eager")
    engine = make_engine(loaded, block_size=4, num_kv_blocks=64)
    sliding = engine.cache_engine.spec.sliding_windows.index(WINDOW)
    full = engine.cache_engine.spec.sliding_windows.index(None)
    add_requests(engine, {"long": prompt}, greedy_params(num_new))
    held, token_ids = [], []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            token_ids.extend(delta.new_token_ids)
        manager = engine.block_manager
        for sequence in manager.tables:  # the one sequence of "long"
            held.append(
                (
                    manager.num_held_blocks(sequence, full),
                    manager.num_held_blocks(sequence, sliding),
                )
            )
            manager.check_invariants()
    assert held[-1][0] == -(-(8 * WINDOW - 1) // 4)  # the full group holds every position
    assert max(num_sliding for _, num_sliding in held) <= WINDOW // 4 + 2
    assert engine.block_manager.pool.usage == 0.0
    assert_matches_reference(token_ids, reference, "gemma2 long")


def test_a_sliding_window_prefix_hit_serves_the_same_tokens_as_hf(default_tokenizer):
    torch.manual_seed(0)
    model = FAMILIES["gemma2"]().float().eval()
    loaded = LoadedModel(model, default_tokenizer, model.config, Path("."), TINY_MAX_MODEL_LEN)
    rng = random.Random(3)
    shared = [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(33)]  # 4x the window
    prompts = {"first": shared + [11, 12], "second": shared + [13, 14, 15]}
    engine = make_engine(loaded, block_size=4, num_kv_blocks=128)
    token_ids = {}
    for request_id, prompt in prompts.items():  # one after the other: the second hits the cache
        add_requests(engine, {request_id: prompt}, greedy_params(MAX_NEW_TOKENS))
        token_ids.update(run_to_completion(engine).token_ids)
    assert engine.stats().prefix_cache_hits >= 32
    for request_id, prompt in prompts.items():
        reference = hf_greedy_reference(model, prompt, MAX_NEW_TOKENS, attn_implementation="eager")
        assert_matches_reference(token_ids[request_id], reference, f"prefix {request_id}")
