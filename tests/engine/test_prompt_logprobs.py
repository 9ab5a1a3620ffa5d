"""Prompt logprobs from the engine equal log_softmax of Hugging Face's forward pass over the same
tokens (float32, max abs error <= 1e-4): with chunked prefill, with the prompt already in the
prefix cache, under preemption, for n > 1, and with max_tokens 0 (the request ends after its
prefill with no token and no leaked block). The default model runs prompts of 1 to 1,000 tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.configs import SamplingParams, SamplingParamsError
from pagedserve.engine.errors import InvalidRequestError
from tests.engine.conftest import (
    EngineRun,
    make_engine,
    make_tiny_model,
    record_plans,
    run_to_completion,
)

MAX_ABS_ERROR = 1e-4


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("llama-gqa", default_tokenizer)


def hf_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[num_tokens, vocab] float32 log_softmax of HF's own (sdpa) forward pass."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([token_ids])).logits[0].float()
    finally:
        model.set_attn_implementation(previous)
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs_match(entries, token_ids, reference, num_top: int) -> None:
    assert len(entries) == len(token_ids) and entries[0] is None
    errors = []
    for position, entry in enumerate(entries[1:], start=1):
        row = reference[position - 1]
        assert entry.token_id == token_ids[position]
        want = float(row[entry.token_id])
        errors.append(abs(entry.logprob - want))
        # 1 + the tokens more likely than it (a token within the tolerance may count either way)
        lowest, highest = (
            int((row > want + tol).sum()) + 1 for tol in (MAX_ABS_ERROR, -MAX_ABS_ERROR)
        )
        assert lowest <= entry.rank <= highest
        top = row.topk(num_top)
        assert [token_id for token_id, _ in entry.top_logprobs] == top.indices.tolist()
        errors.extend(
            abs(value - want)
            for (_, value), want in zip(entry.top_logprobs, top.values.tolist(), strict=True)
        )
    assert max(errors, default=0.0) <= MAX_ABS_ERROR, max(errors)


def preempted_mid_prompt(plans) -> set[str]:
    """Sequences that restarted from an earlier position before their prompt was done."""
    furthest: dict[str, int] = {}
    restarted, sampled = set(), set()
    for plan in plans:
        for s in plan.requests:
            if s.start_position < furthest.get(s.sequence_id, 0) and s.sequence_id not in sampled:
                restarted.add(s.sequence_id)
            furthest[s.sequence_id] = max(furthest.get(s.sequence_id, 0), s.seq_len)
            if s.needs_sample:
                sampled.add(s.sequence_id)
    return restarted


def _prompts(lengths: list[int]) -> dict[str, list[int]]:
    return {
        f"p{length}": [3 + (7 * i + length) % 1000 for i in range(length)] for length in lengths
    }


def test_prompt_logprobs_equal_hf_with_chunked_prefill(tiny_loaded):
    prompts = _prompts([1, 2, 5, 17, 64, 200])
    engine = make_engine(tiny_loaded, block_size=4, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    for request_id, token_ids in prompts.items():
        engine.add_request(request_id, token_ids, params)
    run = run_to_completion(engine)
    assert any(  # the 200-token prompt ran in several chunks
        s.sequence_id == "p200#0" and not s.needs_sample
        for plan in run.plans
        for s in plan.requests
    )
    for request_id, token_ids in prompts.items():
        reference = hf_logprobs(tiny_loaded.model, token_ids)
        assert_prompt_logprobs_match(run.prompt_logprobs[request_id], token_ids, reference, 3)
        assert len(run.token_ids[request_id]) == 2


def test_prompt_logprobs_compute_a_cached_prompt_whole_and_still_fill_the_cache(tiny_loaded):
    token_ids = _prompts([50])["p50"]
    engine = make_engine(tiny_loaded, block_size=4, enable_prefix_caching=True)
    engine.add_request("warm", token_ids, SamplingParams(temperature=0.0, max_tokens=1))
    run_to_completion(engine)
    run = EngineRun()
    record_plans(engine, run)
    engine.add_request("scored", token_ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
    run_to_completion(engine, run)
    (first,) = run.plans[0].requests
    assert first.start_position == 0 and first.num_new_tokens == 50  # no prefix hit
    reference = hf_logprobs(tiny_loaded.model, token_ids)
    assert_prompt_logprobs_match(run.prompt_logprobs["scored"], token_ids, reference, 1)
    # A plain request still hits the cache (48 of 50 tokens: the last block is always computed).
    run = EngineRun()
    record_plans(engine, run)
    engine.add_request("after", token_ids, SamplingParams(temperature=0.0, max_tokens=1))
    run_to_completion(engine, run)
    assert run.plans[0].requests[0].start_position == 48


def test_prompt_logprobs_under_preemption_are_sent_once_with_no_row_lost(tiny_loaded):
    prompts = _prompts([40, 41, 43, 47])
    # 20 blocks of 4 slots cannot hold four 40-token prompts: prefills preempt each other.
    engine = make_engine(
        tiny_loaded,
        block_size=4,
        num_kv_blocks=20,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2, ignore_eos=True)
    for request_id, token_ids in prompts.items():
        engine.add_request(request_id, token_ids, params)
    run = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert preempted_mid_prompt(run.plans), (
        "no prompt was preempted part-way: the test lost its point"
    )
    for request_id, token_ids in prompts.items():
        reference = hf_logprobs(tiny_loaded.model, token_ids)
        assert_prompt_logprobs_match(run.prompt_logprobs[request_id], token_ids, reference, 2)


def test_max_tokens_zero_ends_after_prefill_with_no_token_for_every_choice(tiny_loaded):
    token_ids = _prompts([30])["p30"]
    engine = make_engine(tiny_loaded, block_size=4, max_num_batched_tokens=8)
    engine.add_request("r", token_ids, SamplingParams(n=2, max_tokens=0, prompt_logprobs=0))
    run = run_to_completion(engine)  # also asserts every block is free again
    assert run.finish_reasons == {"r": "length", ("r", 1): "length"}
    assert run.token_ids == {"r": [], ("r", 1): []}
    assert run.prompt_logprobs["r"] == run.prompt_logprobs[("r", 1)]
    stats = engine.stats()
    assert stats.num_generation_tokens == 0 and stats.num_prompt_tokens == 60
    reference = hf_logprobs(tiny_loaded.model, token_ids)
    assert_prompt_logprobs_match(run.prompt_logprobs["r"], token_ids, reference, 0)


def test_n_choices_share_the_parents_prompt_logprobs_and_its_blocks(tiny_loaded):
    token_ids = _prompts([21])["p21"]
    engine = make_engine(tiny_loaded, block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=1)
    engine.add_request("r", token_ids, params)
    run = run_to_completion(engine)
    forked = [s for plan in run.plans for s in plan.requests if s.sequence_id != "r#0"]
    assert forked and all(s.start_position >= 20 for s in forked)  # no choice recomputed it
    assert (
        run.prompt_logprobs["r"] == run.prompt_logprobs[("r", 1)] == run.prompt_logprobs[("r", 2)]
    )


def test_max_tokens_zero_alone_only_prefills_and_fills_the_prefix_cache(tiny_loaded):
    """SGLang's warm-up (max_new_tokens 0): the prompt is computed, nothing is sampled, and the
    next request with that prompt starts from the cache."""
    token_ids = _prompts([50])["p50"]
    engine = make_engine(tiny_loaded, block_size=4, enable_prefix_caching=True)
    engine.add_request("warm", token_ids, SamplingParams(max_tokens=0))
    run = run_to_completion(engine)
    assert run.token_ids["warm"] == [] and run.finish_reasons["warm"] == "length"
    assert [s.needs_sample for plan in run.plans for s in plan.requests] == [False]
    run = EngineRun()
    record_plans(engine, run)
    engine.add_request("after", token_ids, SamplingParams(temperature=0.0, max_tokens=1))
    run_to_completion(engine, run)
    assert run.plans[0].requests[0].start_position == 48
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(max_tokens=-1)
    assert error.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match=r"\(20, --max-logprobs\)") as error:
        engine.add_request("many", token_ids, SamplingParams(prompt_logprobs=21))
    assert error.value.param == "prompt_logprobs" and not engine.has_unfinished_requests()


@pytest.mark.slow
def test_default_model_prompt_logprobs_equal_hf_from_1_to_1000_tokens(
    default_loaded, default_hf_model, default_tokenizer
):
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(120))
    corpus = default_tokenizer.encode(text)
    prompts = {f"p{n}": corpus[n % 50 : n % 50 + n] for n in (1, 2, 9, 130, 1000)}
    prompts["shared"] = prompts["p1000"][:300]  # its prefix is cached when p1000 is done
    engine = make_engine(
        default_loaded,
        block_size=16,
        max_num_batched_tokens=256,  # chunked: smaller than the longest prompt
        # p130 and its 16 tokens hold 10 blocks, p1000 needs 63: p1000 is preempted part-way
        # through its prompt until p130 is done, and recomputes (from its cached prefix).
        num_kv_blocks=66,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    engine.add_request("p130", prompts["p130"], dataclasses.replace(params, max_tokens=16))
    for request_id in ("p1", "p2", "p9", "p1000"):
        engine.add_request(request_id, prompts[request_id], params)
    run = run_to_completion(engine)
    assert "p1000#0" in preempted_mid_prompt(run.plans)
    engine.add_request("shared", prompts["shared"], params)
    run = run_to_completion(engine, run)
    for request_id, token_ids in prompts.items():
        reference = hf_logprobs(default_hf_model, token_ids)
        assert_prompt_logprobs_match(run.prompt_logprobs[request_id], token_ids, reference, 5)
