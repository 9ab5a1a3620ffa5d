"""The rejection sampler on hand-made logits: greedy accepts the argmax-matching prefix plus one
token, random sampling accepts a draft with its target probability, per-position sampling state."""

from __future__ import annotations

import torch

from pagedserve.configs import SamplingParams
from pagedserve.engine.rejection_sampler import RejectionSampler
from pagedserve.engine.sampler import Sampler, SamplingRow


def _row(params: SamplingParams, output=(), seed: int | None = 0) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    banned = [2] if len(output) < params.min_tokens else []
    return SamplingRow("r", params, [5], list(output), 2, generator, banned)


def _peaked(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    """One row per token, with that token the clear argmax."""
    logits = torch.zeros(len(tokens), vocab)
    for index, token in enumerate(tokens):
        logits[index, token] = 5.0
    return logits


def _verify(logits, params, drafts, output=(), seed=0):
    sampler = RejectionSampler(Sampler())
    (run,) = sampler.verify(logits, [_row(params, output, seed)], [tuple(drafts)])
    return [r.token_id for r in run]


GREEDY = SamplingParams(temperature=0.0)


def test_greedy_accepts_all_matching_drafts_plus_the_bonus_token():
    assert _verify(_peaked([3, 4, 1, 0]), GREEDY, [3, 4, 1]) == [3, 4, 1, 0]


def test_greedy_stops_at_the_first_mismatch_with_the_models_token():
    assert _verify(_peaked([3, 5, 1, 0]), GREEDY, [3, 4, 1]) == [3, 5]
    assert _verify(_peaked([0, 4, 1, 0]), GREEDY, [3, 4, 1]) == [0]


def test_greedy_with_processing_uses_each_positions_own_history():
    # presence penalty 2 on seen tokens: at position 1 the accepted draft 3 is history, so the
    # model's 3 loses to 4 there (without the penalty, 3 would be accepted again)
    logits = torch.tensor([[0, 0, 0, 5.0, 4.0, 0], [0, 0, 0, 5.0, 4.0, 0], [0] * 6])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert _verify(logits, params, [3, 3]) == [3, 4]
    assert _verify(logits, SamplingParams(temperature=0.0), [3, 3])[:2] == [3, 3]


def test_min_tokens_bans_eos_only_at_the_positions_below_it():
    logits = _peaked([3, 2, 2])  # EOS (2) is the argmax after the first draft
    params = SamplingParams(temperature=0.0, min_tokens=2, logprobs=0)
    # output has 0 tokens: position 1 is the 2nd output token, still banned; EOS not drafted
    assert _verify(logits, params, [3, 2])[:2] == [3, 0]
    # with one token already out, position 1 is the 3rd: EOS is allowed and accepted
    assert _verify(logits, params, [3, 2], output=[7])[:2] == [3, 2]


def test_random_sampling_accepts_a_draft_with_its_target_probability():
    # p(3) = 0.8 at position 0: the draft is kept 80% of the time, and a rejection never
    # re-emits the draft (the residual zeroes it)
    logits = torch.log(torch.tensor([[0.04, 0.04, 0.04, 0.8, 0.04, 0.04], [1.0] * 6]))
    params = SamplingParams(temperature=1.0)
    firsts = [_verify(logits, params, [3], seed=seed)[0] for seed in range(2000)]
    assert abs(firsts.count(3) / 2000 - 0.8) < 0.03
    runs = [_verify(logits, params, [3], seed=seed) for seed in range(300)]
    assert all(run[0] == 3 and len(run) == 2 or len(run) == 1 for run in runs)


def test_a_draft_the_target_cannot_emit_is_always_rejected():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0], [0.0] * 4])
    params = SamplingParams(temperature=1.0)
    assert all(_verify(logits, params, [2], seed=s)[0] != 2 for s in range(200))


def test_rows_without_drafts_go_through_the_plain_sampler():
    logits = torch.cat([_peaked([4]), _peaked([3, 1])])
    rows = [_row(GREEDY), _row(GREEDY)]
    runs = RejectionSampler(Sampler()).verify(logits, rows, [(), (3,)])
    assert [[r.token_id for r in run] for run in runs] == [[4], [3, 1]]


def test_logprobs_are_reported_for_every_emitted_token():
    params = SamplingParams(temperature=0.0, logprobs=2)
    (run,) = RejectionSampler(Sampler()).verify(_peaked([3, 4]), [_row(params)], [(3,)])
    assert [r.token_id for r in run] == [3, 4]
    assert all(r.logprob is not None and len(r.logprob.top_logprobs) == 2 for r in run)
    assert [r.logprob.token_id for r in run] == [3, 4]
