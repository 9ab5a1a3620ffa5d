"""The one correctness test that matters: on the default model in float32, greedy output of 20
prompts (1 to 1,000 tokens) submitted together equals HF `generate` (sdpa; prompts of similar
lengths batched, left-padded: `hf_greedy_references`) token for token, 64 new tokens each,
across block sizes, chunked prefill, prefix-cache hits and preemption.

EOS: the engine runs with `ignore_eos=True` and HF with `eos_token_id=None`, so both produce
exactly 64 tokens and EOS is compared like any other token (see `hf_greedy_reference`). A
divergence is accepted only at a reference near-tie (top-2 logprob gap < 1e-4), asserted and
warned about by `assert_matches_reference`.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import (
    EngineRun,
    add_requests,
    assert_matches_reference,
    greedy_params,
    hf_greedy_references,
    make_engine,
    record_plans,
    run_to_completion,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the limit allows for a loaded machine

MAX_NEW_TOKENS = 64
SYSTEM_PROMPT = (
    "You are a meticulous assistant for a small observatory. Answer in plain English, cite the "
    "instrument you would use, keep every answer under three sentences, and say so when unsure."
)
QUESTIONS = ["What is a light year?", "Why do stars twinkle?", "How far away is the Moon?"]
PASSAGES = [
    "The Roman Empire reached its greatest extent under Trajan in 117 AD, stretching from Britain to Mesopotamia. ",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen. ",
    "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。 ",
    "Le chat dort sur le canapé pendant que la pluie tombe doucement sur les toits de Paris. ",
    "| year | revenue | margin |\n| 2021 | 4.2M | 12% |\n| 2022 | 5.1M | 14% |\n",
    "Once upon a time, a lighthouse keeper found a bottle with a map to an island that was not there. ",
    "SELECT name, COUNT(*) FROM orders JOIN users ON users.id = orders.user_id GROUP BY name; ",
]
# Skewed lengths: two long prompts and many short/medium ones keep the file within minutes.
RAW_PROMPT_LENGTHS = [1000, 1, 2, 3, 5, 8, 13, 17, 24, 31, 40, 57, 90, 128, 177, 256, 420]


def _build_prompts(tokenizer) -> dict[str, list[int]]:
    corpus = "".join(PASSAGES[i % len(PASSAGES)] + f"[{i}] " for i in range(400))
    corpus_ids = tokenizer.encode(corpus)
    prompts = {}
    for index, length in enumerate(RAW_PROMPT_LENGTHS):
        start = (index * 97) % 400  # different content per prompt
        prompts[f"raw{length}"] = corpus_ids[start : start + length]
    for index, question in enumerate(QUESTIONS):  # share the chat template and the system prompt
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ]
        prompts[f"chat{index}"] = list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    assert len(prompts) >= 20 and {len(p) for p in prompts.values()} >= {1, 1000}
    return prompts


@pytest.fixture(scope="session")
def prompts(default_tokenizer) -> dict[str, list[int]]:
    return _build_prompts(default_tokenizer)


@pytest.fixture(scope="session")
def references(default_hf_model, prompts):
    """HF greedy references (Hugging Face's own model, none of the loader's CPU swaps), computed
    once per session and reused for every configuration."""
    return hf_greedy_references(default_hf_model, prompts, MAX_NEW_TOKENS)


def _whole_batch_blocks(block_size: int) -> int:
    """Enough blocks for every prompt of the batch plus its output at once (no preemption)."""
    return 4096 // block_size + 32


def _check_all(run: EngineRun, references, label: str) -> None:
    for request_id, reference in references.items():
        assert run.finish_reasons[request_id] == "length", f"{label} {request_id}"
        assert_matches_reference(run.token_ids[request_id], reference, f"{label} {request_id}")


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_greedy_output_equals_hf_generate_for_block_size(
    default_loaded, prompts, references, block_size
):
    engine = make_engine(
        default_loaded,
        block_size=block_size,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        num_kv_blocks=_whole_batch_blocks(block_size),
    )
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    _check_all(run_to_completion(engine), references, f"block_size={block_size}")


def test_greedy_output_equals_hf_generate_with_chunked_prefill(default_loaded, prompts, references):
    engine = make_engine(
        default_loaded,
        block_size=16,
        max_num_batched_tokens=72,
        enable_prefix_caching=False,
        num_kv_blocks=_whole_batch_blocks(16),
    )
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    num_partial_chunks = sum(not s.needs_sample for plan in run.plans for s in plan.requests)
    assert num_partial_chunks >= 1000 // 72, "long prompts must be split into chunks"
    _check_all(run, references, "chunked prefill")


def test_greedy_output_equals_hf_generate_without_chunked_prefill(
    default_loaded, prompts, references
):
    # vLLM's --no-enable-chunked-prefill: every prompt runs whole in one step, the step budget
    # (left unset) grown to max_model_len so that the longest prompt fits.
    engine = make_engine(
        default_loaded,
        block_size=16,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        num_kv_blocks=_whole_batch_blocks(16),
    )
    assert engine.scheduler.config.max_num_batched_tokens == engine.max_model_len
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    assert all(s.needs_sample for plan in run.plans for s in plan.requests), "no partial chunk"
    _check_all(run, references, "no chunked prefill")


def test_greedy_output_equals_hf_generate_with_prefix_cache_hits(
    default_loaded, prompts, references
):
    engine = make_engine(
        default_loaded,
        block_size=16,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
        num_kv_blocks=_whole_batch_blocks(16),
    )
    run = EngineRun()
    record_plans(engine, run)
    params = greedy_params(MAX_NEW_TOKENS)
    engine.add_request("chat0", prompts["chat0"], params)
    engine.step()  # prefills chat0 and caches its full blocks: the system prompt
    add_requests(engine, {rid: p for rid, p in prompts.items() if rid != "chat0"}, params)
    run_to_completion(engine, run)
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    _check_all(run, {rid: r for rid, r in references.items() if rid != "chat0"}, "prefix cache")


def test_greedy_output_equals_hf_generate_under_preemption(default_loaded, prompts, references):
    # 72 blocks x 16 = 1152 slots: the 1,000-token prompt (+63) fits alone, the whole batch by far not.
    engine = make_engine(
        default_loaded,
        block_size=16,
        num_kv_blocks=72,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    _check_all(run, references, "preemption")


# ---- with n-gram speculation: drafts verified in the same flattened batch ---------------------

SPECULATIVE = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
    '"prompt_lookup_max": 4, "disable_by_batch_size": 64, "min_acceptance_rate": 0.0}'
)


def _check_speculated(engine, run: EngineRun, references, label: str) -> None:
    _check_all(run, references, label)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens > 0, f"{label}: no draft was ever accepted"
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens, f"{label}: none rejected"


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_output_with_speculation_equals_hf_generate_for_block_size(
    default_loaded, prompts, references, block_size
):
    engine = make_engine(
        default_loaded,
        block_size=block_size,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
        num_kv_blocks=_whole_batch_blocks(block_size),
        speculative_config=SPECULATIVE,
    )
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    _check_speculated(engine, run, references, f"speculation block_size={block_size}")


def test_greedy_output_with_speculation_equals_hf_generate_with_chunked_prefill(
    default_loaded, prompts, references
):
    engine = make_engine(
        default_loaded,
        block_size=16,
        max_num_batched_tokens=72,
        num_kv_blocks=_whole_batch_blocks(16),
        speculative_config=SPECULATIVE,
    )
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    assert sum(not s.needs_sample for plan in run.plans for s in plan.requests) >= 1000 // 72
    _check_speculated(engine, run, references, "speculation, chunked prefill")


def test_greedy_output_with_speculation_equals_hf_generate_under_preemption(
    default_loaded, prompts, references
):
    engine = make_engine(
        default_loaded,
        block_size=16,
        num_kv_blocks=72,
        max_num_batched_tokens=512,
        speculative_config=SPECULATIVE,
    )
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    _check_speculated(engine, run, references, "speculation, preemption")
