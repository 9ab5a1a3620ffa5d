"""The last decoder layer computing only the rows whose logits are kept (engine/kept_rows.py): the
same logits as the whole layer in every step, the whole layer wherever nothing would be skipped,
and only Llama's formula with the fused attention is swapped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.configs import SamplingParams
from pagedserve.engine.fused_attention import fuse_attention
from pagedserve.engine.kept_rows import (
    KeptRowsDecoderLayer,
    can_keep_rows,
    keep_rows_in_last_layer,
    keeps_rows,
)
from pagedserve.engine.model_loader import LoadedModel
from tests.engine.conftest import make_engine, make_tiny_model
from tests.engine.test_speculative import spec_json

# Prompts of several chunks under a 16-token budget, and short ones finishing beside them.
PROMPTS = {f"p{i}": [(5 * i + j * j) % 60 + 3 for j in range(3 + 11 * i)] for i in range(5)}


def _kept_rows_model(default_tokenizer, dtype: torch.dtype) -> LoadedModel:
    loaded = make_tiny_model("llama-gqa", default_tokenizer)
    model = loaded.model.to(dtype)
    assert fuse_attention(model) == model.config.num_hidden_layers
    assert keep_rows_in_last_layer(model)
    return loaded


def _each_step_both_ways(loaded, params, prompts=PROMPTS, **settings):
    """Runs the prompts to completion; each step's batch is also run with the last layer whole.
    Returns, per step, (plan, batch, logits with kept rows, logits with the whole layer)."""
    engine = make_engine(loaded, dtype=str(loaded.model.dtype).removeprefix("torch."), **settings)
    assert engine.runner.keeps_rows
    steps = []
    prepare, forward = engine.runner.prepare, engine.runner.forward

    def both_ways(plan):
        batch = prepare(plan)
        # The whole layer first: a second forward stores the same K/V at the same slots again.
        whole = forward(dataclasses.replace(batch, kept=None))
        steps.append((plan, batch, forward(batch), whole))
        return batch

    engine.runner.prepare = both_ways
    engine.runner.forward = lambda batch: steps[-1][2]
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return steps


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("speculation", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_kept_rows_give_the_whole_layers_logits_in_every_step(
    default_tokenizer, dtype, tolerance, speculation, backend
):
    loaded = _kept_rows_model(default_tokenizer, dtype)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    settings = dict(block_size=4, max_num_batched_tokens=16, attention_backend=backend)
    if speculation:
        settings["speculative_config"] = spec_json(k=3)
    steps = _each_step_both_ways(loaded, params, **settings)
    kept_steps = 0
    for plan, batch, kept_logits, whole_logits in steps:
        assert kept_logits.shape == whole_logits.shape
        torch.testing.assert_close(kept_logits, whole_logits, rtol=tolerance, atol=tolerance)
        if batch.kept is None:
            continue
        kept_steps += 1
        assert batch.kept.rows.tolist() == batch.logits_indices.tolist()
        kept_requests = [s for s in plan.requests if s.needs_sample]
        meta = batch.kept.metas[0]
        assert meta.seq_lens.tolist() == [s.seq_len for s in kept_requests]
        lengths = meta.query_start_loc.diff().tolist()
        assert lengths == [1 + len(s.draft_token_ids) for s in kept_requests]
    assert kept_steps >= 3, "prefill chunks finishing beside others must skip rows"


def test_the_layer_runs_whole_where_nothing_would_be_skipped(default_tokenizer):
    loaded = _kept_rows_model(default_tokenizer, torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    settings = dict(block_size=4, max_num_batched_tokens=16)
    steps = _each_step_both_ways(loaded, params, **settings)
    # One long prompt alone: its first chunks sample nothing.
    steps += _each_step_both_ways(loaded, params, {"long": list(range(3, 53))}, **settings)
    seen = set()
    for plan, batch, _, _ in steps:
        sampled = sum(s.needs_sample for s in plan.requests)
        if all(s.num_new_tokens == 1 for s in plan.requests):  # decode: every row is kept
            seen.add("decode")
            assert batch.kept is None
        elif sampled == 0:  # only chunks in the middle of prompts: no row is kept
            seen.add("no sampling")
            assert batch.kept is None
        else:
            seen.add("kept")
            assert batch.kept is not None
    assert seen == {"decode", "no sampling", "kept"}


def test_prompt_logprob_rows_run_the_layer_whole(default_tokenizer):
    loaded = _kept_rows_model(default_tokenizer, torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    steps = _each_step_both_ways(loaded, params, block_size=4, max_num_batched_tokens=16)
    assert any(s.prompt_logprob_rows for plan, _, _, _ in steps for s in plan.requests)
    for plan, batch, kept_logits, whole_logits in steps:
        if any(s.prompt_logprob_rows for s in plan.requests):
            assert batch.kept is None
        torch.testing.assert_close(kept_logits, whole_logits, rtol=1e-5, atol=1e-5)


def test_only_llamas_decoder_layer_with_the_fused_attention_is_swapped(default_tokenizer):
    llama = make_tiny_model("llama-gqa", default_tokenizer).model
    assert not can_keep_rows(llama), "an unfused attention cannot take a subset of queries"
    fuse_attention(llama)
    last = llama.model.layers[-1]
    assert can_keep_rows(llama) and keep_rows_in_last_layer(llama)
    swapped = llama.model.layers[-1]
    assert isinstance(swapped, KeptRowsDecoderLayer) and keeps_rows(llama)
    assert swapped.self_attn is last.self_attn and swapped.mlp is last.mlp
    assert not isinstance(llama.model.layers[0], KeptRowsDecoderLayer), "only the last layer"
    assert not can_keep_rows(llama), "and only once"
    # Qwen3 normalises q and k: its attention stays unfused, so its layers stay whole.
    qwen3 = make_tiny_model("qwen3-gqa", default_tokenizer).model
    fuse_attention(qwen3)
    assert not keep_rows_in_last_layer(qwen3) and not keeps_rows(qwen3)


def test_the_default_model_keeps_rows_with_an_unchanged_state_dict(default_loaded):
    model = default_loaded.model
    assert isinstance(model.model.layers[-1], KeptRowsDecoderLayer)
    names = {name for name, _ in model.model.layers[-1].named_parameters()}
    assert names == {name for name, _ in model.model.layers[-2].named_parameters()}
