"""Greedy equality with HF `generate` on tiny random-weight Llama, Qwen2, Qwen3 and Mistral models
(GQA and MHA; head_dim 16 and 32), across block sizes 1/5/16 with chunked prefill, all prompts
submitted together."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagedserve.cache.attention import TorchPagedAttention
from pagedserve.cache.cache_engine import CacheEngine
from pagedserve.cache.cache_spec import CacheSpec
from pagedserve.engine.model_runner import ModelRunner
from tests.engine.conftest import (
    TINY_FAMILIES,
    TINY_VOCAB_SIZE,
    add_requests,
    assert_matches_reference,
    greedy_params,
    hf_greedy_reference,
    make_engine,
    make_tiny_model,
    run_to_completion,
)

PROMPT_LENGTHS = [1, 2, 4, 5, 9, 16, 17, 33, 64, 120]
MAX_NEW_TOKENS = 16


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(1234)
    return {
        f"p{length}": [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(length)]
        for length in PROMPT_LENGTHS
    }


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family_case(request, default_tokenizer):
    """(family, loaded model, HF references): references computed once per family."""
    loaded = make_tiny_model(request.param, default_tokenizer)
    references = {
        rid: hf_greedy_reference(loaded.model, prompt, MAX_NEW_TOKENS)
        for rid, prompt in _prompts().items()
    }
    distinct = {tuple(reference.token_ids) for reference in references.values()}
    assert len(distinct) > len(references) // 2, (
        "the tiny model's outputs are too degenerate to compare"
    )
    return request.param, loaded, references


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens", "attention_backend"),
    [(1, 24, "auto"), (5, 13, "auto"), (16, 40, "auto"), (16, 2048, "auto"), (5, 13, "torch")],
    ids=["bs1-chunk24", "bs5-chunk13", "bs16-chunk40", "bs16-unchunked", "bs5-chunk13-torch"],
)
def test_tiny_model_greedy_output_equals_hf_generate(
    family_case, block_size, max_num_batched_tokens, attention_backend
):
    family, loaded, references = family_case
    engine = make_engine(
        loaded,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        attention_backend=attention_backend,
        num_kv_blocks=4096 // block_size,
    )
    add_requests(engine, _prompts(), greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    if max_num_batched_tokens < max(PROMPT_LENGTHS):
        assert any(not s.needs_sample for plan in run.plans for s in plan.requests), (
            "no chunked prefill happened"
        )
    for request_id, reference in references.items():
        assert_matches_reference(
            run.token_ids[request_id], reference, f"{family} bs={block_size} {request_id}"
        )
        assert run.finish_reasons[request_id] == "length"


def test_tiny_model_greedy_output_equals_hf_generate_under_preemption(family_case):
    family, loaded, references = family_case
    # 12 blocks of 4 = 48 slots: the 120-token prompt does not fit, so only the others run.
    prompts = {rid: prompt for rid, prompt in _prompts().items() if len(prompt) <= 33}
    engine = make_engine(loaded, block_size=4, num_kv_blocks=13, max_num_batched_tokens=32)
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    for request_id in prompts:
        assert_matches_reference(
            run.token_ids[request_id], references[request_id], f"{family} preempted {request_id}"
        )


def _tiny(model_class: type, config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_class(config).float().eval()


UNSERVABLE = {
    # transformers keeps its own attention for classes outside AttentionInterface: no history.
    "bloom": (
        lambda: _tiny(
            transformers.BloomForCausalLM,
            transformers.BloomConfig(vocab_size=128, hidden_size=64, n_head=4, n_layer=2),
        ),
        "AttentionInterface",
    ),
    "phi3-longrope": (
        lambda: _tiny(
            transformers.Phi3ForCausalLM,
            transformers.Phi3Config(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=2,
                max_position_embeddings=256,
                original_max_position_embeddings=64,
                pad_token_id=0,
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                },
            ),
        ),
        "longrope",
    ),
}


@pytest.mark.parametrize("family", list(UNSERVABLE))
def test_a_model_the_paged_attention_cannot_serve_exactly_is_refused_at_load(family, tmp_path):
    # Serving it would silently give wrong logits (measured: 0.05-0.7 off); refusing names why.
    make_model, reason = UNSERVABLE[family]
    model = make_model()
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_size=4)
    with pytest.raises(ValueError, match=reason):
        ModelRunner(model, CacheEngine(spec, num_blocks=8, device="cpu"), TorchPagedAttention())


def test_an_engine_without_chunked_prefill_refuses_a_step_budget_below_its_model_length(
    default_tokenizer,
):
    # vLLM's start-up check: a prompt longer than the budget could never be admitted whole.
    loaded = make_tiny_model("llama-gqa", default_tokenizer)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(256\) is smaller than"):
        make_engine(loaded, enable_chunked_prefill=False, max_num_batched_tokens=256)
    engine = make_engine(loaded, enable_chunked_prefill=False, max_num_batched_tokens=512)
    assert engine.scheduler.config.max_num_batched_tokens == 512 == engine.max_model_len
