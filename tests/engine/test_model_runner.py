"""ModelRunner: slot mapping from the block tables, logits only where sampled (and equal to the full
HF forward there), and `paged_context` reaching the attention adapter through kwargs per family."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pagedserve.cache.block_table import BlockTable
from pagedserve.configs import SamplingParams
from pagedserve.engine.model_runner import (
    ATTN_IMPLEMENTATION,
    PagedContext,
    paged_attention_forward,
)
from tests.engine.conftest import TINY_FAMILIES, make_engine, make_tiny_model

PROMPTS = {"a": list(range(10, 47)), "b": [5, 6, 7], "c": list(range(100, 120))}


def _engine_with_spy(loaded, **settings):
    """An engine whose runner records each prepared batch and each step's logits."""
    engine = make_engine(loaded, **settings)
    batches, logits_seen = [], []
    prepare, forward = engine.runner.prepare, engine.runner.forward

    def spy_prepare(plan):
        batch = prepare(plan)
        batches.append((plan, batch))
        return batch

    def spy_forward(batch):
        logits = forward(batch)
        logits_seen.append(logits)
        return logits

    engine.runner.prepare, engine.runner.forward = spy_prepare, spy_forward
    return engine, batches, logits_seen


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("qwen3-gqa", default_tokenizer)


def test_slot_mapping_equals_the_block_tables_slot_mapping(tiny_loaded):
    engine, batches, _ = _engine_with_spy(tiny_loaded, block_size=4, max_num_batched_tokens=16)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(
            request_id, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
        plan, batch = batches[-1]
        expected = []
        for scheduled in plan.requests:
            table = engine.block_manager.tables.get(scheduled.sequence_id)
            if table is not None:  # still running: its table is the one the step wrote through
                assert scheduled.block_tables[0] == table.block_ids
            expected += scheduled.slot_mappings[0]
            rebuilt = BlockTable(4, list(scheduled.block_tables[0]))
            assert scheduled.slot_mappings[0] == rebuilt.slot_mapping(
                scheduled.start_position, scheduled.seq_len
            )
        assert batch.metas[0].slot_mapping.tolist() == expected
        assert batch.position_ids[0].tolist() == [
            pos for s in plan.requests for pos in range(s.start_position, s.seq_len)
        ]
    assert len(batches) > 3


def test_logits_are_computed_only_for_sampled_positions_and_equal_the_full_forward(tiny_loaded):
    engine, batches, logits_seen = _engine_with_spy(
        tiny_loaded, block_size=4, max_num_batched_tokens=16
    )
    for request_id, prompt in PROMPTS.items():
        engine.add_request(
            request_id, prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        )
    saw_partial_chunk = False
    while engine.has_unfinished_requests():
        engine.step()
        plan, batch = batches[-1]
        num_sampled = sum(s.needs_sample for s in plan.requests)
        saw_partial_chunk |= num_sampled < len(plan.requests)
        assert logits_seen[-1].shape == (num_sampled, tiny_loaded.hf_config.vocab_size)
        assert logits_seen[-1].dtype == torch.float32
        assert batch.logits_indices.tolist() == [
            end - 1
            for s, end in zip(
                plan.requests, batch.metas[0].query_start_loc[1:].tolist(), strict=True
            )
            if s.needs_sample
        ]
    assert saw_partial_chunk, "the budget should split prompt a into chunks"
    # The first logits of a prompt equal a plain sdpa forward of the whole prompt at its last position.
    model = tiny_loaded.model
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            full = model(torch.tensor([PROMPTS["b"]])).logits[0, -1]
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    step = next(
        i
        for i, (plan, _) in enumerate(batches)
        if any(s.sequence_id == "b#0" for s in plan.requests)
    )
    row = [s.sequence_id for s in batches[step][0].requests if s.needs_sample].index("b#0")
    torch.testing.assert_close(logits_seen[step][row], full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_attention_adapter_receives_paged_context_through_kwargs(default_tokenizer, family):
    loaded = make_tiny_model(family, default_tokenizer)
    engine = make_engine(loaded, block_size=4)
    calls: list[tuple[int, object]] = []

    def spy(module, query, key, value, attention_mask, scaling=None, paged_context=None, **kwargs):
        calls.append((module.layer_idx, paged_context))
        return paged_attention_forward(
            module, query, key, value, attention_mask, scaling, paged_context, **kwargs
        )

    ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION] = spy  # a local override of this one mapping
    try:
        engine.add_request(
            "r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        )
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
    num_layers = loaded.hf_config.num_hidden_layers
    assert [layer for layer, _ in calls] == list(range(num_layers)) * 2
    assert all(isinstance(context, PagedContext) for _, context in calls)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_model_called_without_paged_context_fails_loudly(default_tokenizer, family):
    loaded = make_tiny_model(family, default_tokenizer)
    make_engine(loaded, block_size=4)  # switches the model to the paged attention
    with pytest.raises(RuntimeError, match="paged_context"), torch.inference_mode():
        loaded.model(torch.tensor([[5, 6, 7]]), use_cache=False)
