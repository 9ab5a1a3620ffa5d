"""The scheduler's pressure test through the real engine on the default model: 16 concurrent
requests on a pool of 24 blocks of 4 tokens give exactly the outputs of an unconstrained run."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import add_requests, greedy_params, make_engine, run_to_completion

NUM_REQUESTS = 16
POOL_BLOCKS, BLOCK_SIZE = 24, 4  # 96 slots: one or two requests fit at a time


@pytest.mark.slow
def test_engine_under_a_tiny_pool_equals_an_unconstrained_run(default_loaded):
    rng = random.Random(7)
    vocab = default_loaded.hf_config.vocab_size
    requests = []
    for index in range(NUM_REQUESTS):
        num_prompt = rng.randint(10, 40)
        # prompt + max_tokens - 1 slots must fit the whole pool, or admission rejects it
        max_tokens = rng.randint(20, min(60, POOL_BLOCKS * BLOCK_SIZE - num_prompt + 1))
        prompt = [rng.randrange(3, vocab) for _ in range(num_prompt)]
        requests.append((f"r{index}", prompt, max_tokens))

    def run(**settings):
        engine = make_engine(default_loaded, **settings)
        for request_id, prompt, max_tokens in requests:
            add_requests(engine, {request_id: prompt}, greedy_params(max_tokens))
        return engine, run_to_completion(engine)

    _, unconstrained = run(num_kv_blocks=2048, block_size=16)
    pressured_engine, pressured = run(
        num_kv_blocks=POOL_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=64
    )

    assert pressured_engine.stats().num_preemptions > 0
    assert pressured.token_ids == unconstrained.token_ids
    assert all(reason == "length" for reason in pressured.finish_reasons.values())
