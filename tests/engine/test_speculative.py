"""Speculative decoding end to end on tiny random models: greedy output token-identical to no
speculation (logprobs, penalties, stops, n > 1, small blocks), and seeded random sampling drawing
from the same distribution (a two-sample chi-square test on a 6-token vocabulary)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.configs import SamplingParams
from pagedserve.engine.model_loader import LoadedModel
from pagedserve.engine.rejection_sampler import RejectionSampler
from tests.engine.conftest import make_engine, make_tiny_model, run_to_completion


def spec_json(k: int = 4, batch_gate: int = 64) -> str:
    return (
        f'{{"method": "ngram", "num_speculative_tokens": {k}, "prompt_lookup_min": 1, '
        f'"prompt_lookup_max": 3, "disable_by_batch_size": {batch_gate}, '
        '"min_acceptance_rate": 0.0}'
    )


@pytest.fixture(scope="module")
def tiny(default_tokenizer) -> LoadedModel:
    return make_tiny_model("llama-gqa", default_tokenizer)


def _run(loaded, prompts, params, **settings):
    engine = make_engine(loaded, **settings)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return run_to_completion(engine), engine.stats()


PROMPTS = {f"p{i}": [(7 * i + j * j) % 50 + 3 for j in range(5 + 9 * i)] for i in range(6)}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2, min_tokens=5),
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            ignore_eos=True,
            n=2,
            stop=["reschool reschool", "ataety", "BBBB", "li li li"],  # inside repetitions
        ),
    ],
    ids=["plain", "logprobs", "penalty", "n2-stop"],
)
def test_greedy_output_with_speculation_equals_without(tiny, block_size, params):
    settings = dict(block_size=block_size, max_num_batched_tokens=64)
    off, _ = _run(tiny, PROMPTS, params, **settings)
    on, stats = _run(tiny, PROMPTS, params, speculative_config=spec_json(), **settings)
    assert on.token_ids == off.token_ids
    assert on.texts == off.texts and on.finish_reasons == off.finish_reasons
    assert stats.spec_num_accepted_tokens > 0, "the test must exercise accepted drafts"
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens, "and rejected ones"
    if params.stop:
        assert list(on.finish_reasons.values()).count("stop") >= 6, "stop strings must end some"


def test_speculation_off_drafts_nothing(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    run, stats = _run(tiny, PROMPTS, params)
    assert not any(s.draft_token_ids for plan in run.plans for s in plan.requests)
    assert stats.spec_num_draft_tokens == 0 and stats.spec_num_accepted_per_position == ()


# ---- distribution: a 6-token random model -------------------------------------------------------

VOCAB = 6
NUM_DRAWS = 3000


@pytest.fixture(scope="module")
def six_token_model(default_tokenizer) -> LoadedModel:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.3,  # peaked, history-dependent next-token distributions
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).float().eval()
    return LoadedModel(model, default_tokenizer, model.config, Path("."), 64)


def _histograms(
    loaded, seeds: range, speculative: bool, check_rejections: bool = True
) -> tuple[Counter, Counter]:
    """Counts of (2nd, 3rd) output tokens and of the 4th, over one seeded request per seed."""
    params = dict(temperature=0.9, top_p=0.95, presence_penalty=0.5, max_tokens=4, ignore_eos=True)
    engine = make_engine(
        loaded,
        block_size=4,
        max_num_seqs=64,
        **({"speculative_config": spec_json(k=3)} if speculative else {}),
    )
    for seed in seeds:
        engine.add_request(f"s{seed}", [3, 4, 5, 3, 4], SamplingParams(seed=seed, **params))
    run = run_to_completion(engine)
    pairs = Counter(tuple(run.token_ids[f"s{seed}"][1:3]) for seed in seeds)
    fourth = Counter(run.token_ids[f"s{seed}"][3] for seed in seeds)
    if speculative and check_rejections:
        stats = engine.stats()
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    return pairs, fourth


def _chi_square_z(a: Counter, b: Counter) -> float:
    """Two-sample chi-square (equal sizes) as a standard normal z (Wilson-Hilferty)."""
    cells = [key for key in set(a) | set(b) if a[key] + b[key] > 0]
    statistic = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in cells)
    df = len(cells) - 1
    return ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


@pytest.mark.timeout(900)
def test_random_sampling_with_speculation_draws_from_the_same_distribution(six_token_model):
    off_pairs, off_fourth = _histograms(six_token_model, range(NUM_DRAWS), speculative=False)
    on_pairs, on_fourth = _histograms(
        six_token_model, range(NUM_DRAWS, 2 * NUM_DRAWS), speculative=True
    )
    assert len(off_pairs) >= 10, "the distribution must not be degenerate"
    # z < 3.3: p > 0.0005 per statistic; a wrong acceptance rule moves z by tens (below)
    z_pairs, z_fourth = _chi_square_z(off_pairs, on_pairs), _chi_square_z(off_fourth, on_fourth)
    print(f"chi-square z: pairs {z_pairs:.2f}, fourth {z_fourth:.2f}")
    assert z_pairs < 3.3 and z_fourth < 3.3


@pytest.mark.timeout(900)
def test_the_chi_square_test_catches_a_sampler_that_always_accepts(six_token_model, monkeypatch):
    def accept_every_draft(self, logits, row, draft):
        return draft if draft is not None else original(self, logits, row, draft)

    original = RejectionSampler._sample_position
    monkeypatch.setattr(RejectionSampler, "_sample_position", accept_every_draft)
    off_pairs, _ = _histograms(six_token_model, range(NUM_DRAWS // 3), speculative=False)
    on_pairs, _ = _histograms(
        six_token_model, range(NUM_DRAWS // 3), speculative=True, check_rejections=False
    )
    z_pairs = _chi_square_z(off_pairs, on_pairs)
    print(f"chi-square z of an always-accepting sampler: {z_pairs:.1f}")
    assert z_pairs > 5


def test_constrained_sequences_never_draft_and_both_kinds_match_no_speculation(default_loaded):
    from pagedserve.configs import StructuredOutputs

    tokenizer = default_loaded.tokenizer
    free = tokenizer.encode("one two three four one two three four one two three four one two")
    constrained = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs("regex", r"[a-c]{9}")
    )
    outputs = []
    for settings in ({}, {"speculative_config": spec_json()}):
        engine = make_engine(default_loaded, block_size=16, **settings)
        engine.add_request("free", free, SamplingParams(temperature=0.0, max_tokens=24))
        engine.add_request("regex", free, constrained)
        run = run_to_completion(engine)
        outputs.append((run.token_ids, run.texts, run.finish_reasons))
        drafted = {s.sequence_id for plan in run.plans for s in plan.requests if s.draft_token_ids}
        assert not any(sid.startswith("regex") for sid in drafted)
    assert outputs[0] == outputs[1]
    assert outputs[1][1]["regex"] and set(outputs[1][1]["regex"]) <= set("abc")
    assert drafted, "the unconstrained neighbour must have drafted"
