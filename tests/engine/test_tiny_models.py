"""Greedy equality with HF `generate` on tiny random-weight Llama, Qwen2, Qwen3 and Mistral models
(GQA and MHA; head_dim 16 and 32), across block sizes 1/5/16 with chunked prefill, all prompts
submitted together."""

from __future__ import annotations

import random

import pytest

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
    return {f"p{length}": [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(length)] for length in PROMPT_LENGTHS}


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family_case(request, default_tokenizer):
    """(family, loaded model, HF references): references computed once per family."""
    loaded = make_tiny_model(request.param, default_tokenizer)
    references = {rid: hf_greedy_reference(loaded.model, prompt, MAX_NEW_TOKENS) for rid, prompt in _prompts().items()}
    distinct = {tuple(reference.token_ids) for reference in references.values()}
    assert len(distinct) > len(references) // 2, "the tiny model's outputs are too degenerate to compare"
    return request.param, loaded, references


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens", "attention_backend"),
    [(1, 24, "auto"), (5, 13, "auto"), (16, 40, "auto"), (16, 2048, "auto"), (5, 13, "torch")],
    ids=["bs1-chunk24", "bs5-chunk13", "bs16-chunk40", "bs16-unchunked", "bs5-chunk13-torch"],
)
def test_tiny_model_greedy_output_equals_hf_generate(family_case, block_size, max_num_batched_tokens,
                                                     attention_backend):
    family, loaded, references = family_case
    engine = make_engine(loaded, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                         attention_backend=attention_backend, num_kv_blocks=4096 // block_size)
    add_requests(engine, _prompts(), greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    if max_num_batched_tokens < max(PROMPT_LENGTHS):
        assert any(not s.needs_sample for plan in run.plans for s in plan.requests), "no chunked prefill happened"
    for request_id, reference in references.items():
        assert_matches_reference(run.token_ids[request_id], reference, f"{family} bs={block_size} {request_id}")
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
        assert_matches_reference(run.token_ids[request_id], references[request_id], f"{family} preempted {request_id}")
