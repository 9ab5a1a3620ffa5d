"""Sampler unit tests on hand-made logits, and engine-level sampling: seeded reproducibility
independent of the batch, min_tokens, and n=4 sharing the prompt's blocks with copy-on-write."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pagedserve.configs import SamplingParams
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampler import NoTokenLeftError, Sampler, SamplingRow, takes_only_argmax
from tests.engine.conftest import (
    EngineRun,
    make_engine,
    make_tiny_model,
    record_plans,
    run_to_completion,
)

EOS = 2


def _row(
    params: SamplingParams, *, prompt=(5,), output=(), seed: int | None = None, banned=()
) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow("r", params, list(prompt), list(output), EOS, generator, list(banned))


def _draw_many(logits: list[float], params: SamplingParams, num_draws: int = 2000) -> list[int]:
    row = _row(params, seed=0)
    sampler = Sampler(seed=0)
    tensor = torch.tensor([logits])
    return [sampler.sample(tensor, [row])[0].token_id for _ in range(num_draws)]


# ---- Sampler units -----------------------------------------------------------------------------


def test_greedy_picks_the_argmax_of_each_row():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert [r.token_id for r in Sampler().sample(logits, rows)] == [1, 0]


def test_greedy_breaks_ties_as_argmax_does_on_wide_rows():
    """HF generate takes `argmax`; the engine's faster reduction must pick the same tied index."""
    logits = torch.zeros(3, 49_152)
    logits[0, [7, 40_000]] = 1.0
    logits[1, [48_000, 5, 30_000]] = 2.0
    logits[2] = -1.0  # all tied
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(3)]
    chosen = [r.token_id for r in Sampler().sample(logits, rows)]
    assert chosen == logits.argmax(dim=-1).tolist() == [7, 5, 0]


def test_temperature_sampling_follows_the_softmax_of_scaled_logits():
    logits = [0.0, math.log(3.0), -30.0]  # p = [0.25, 0.75, ~0] at T=1; at T=2: [1/(1+sqrt3), ...]
    draws = _draw_many(logits, SamplingParams(temperature=2.0))
    expected_p1 = math.sqrt(3.0) / (1.0 + math.sqrt(3.0))
    assert abs(draws.count(1) / len(draws) - expected_p1) < 0.04
    assert 2 not in draws


def test_low_temperature_sampling_is_effectively_greedy():
    draws = _draw_many([1.0, 1.5, 0.5], SamplingParams(temperature=0.01), num_draws=200)
    assert set(draws) == {1}


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 5e-324])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    # logits / 1e-40 overflows float32: sampling from it would draw from NaN probabilities.
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy
    assert set(_draw_many([1.0, 1.5, 0.5], params, num_draws=20)) == {1}


def test_top_k_samples_only_the_k_most_likely_tokens():
    draws = _draw_many([1.0, 1.2, 1.1, 0.9, 1.05], SamplingParams(temperature=1.0, top_k=2))
    assert set(draws) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).tolist()
    draws = _draw_many(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert set(draws) == {0, 1}


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(top_p):
    # Compared in float32, top_p rounds to 0 and every token "already reaches" it: the filter
    # would leave nothing to draw, and an all-zero row's argmax is token 0.
    draws = _draw_many([0.5, 2.0, 1.0], SamplingParams(temperature=1.0, top_p=top_p), 50)
    assert set(draws) == {1}


@pytest.mark.parametrize("temperature", [1.0, 1e-4])
def test_a_repetition_penalty_that_overflows_a_logit_draws_among_the_boosted_tokens(temperature):
    # 2.0 / 1e-39 overflows float32 to +inf for each seen positive logit: the softmax of a row
    # with +inf is NaN. The overflowed tokens share the probability instead.
    params = SamplingParams(temperature=temperature, repetition_penalty=1e-39)
    row = _row(params, prompt=[1, 3], seed=0)
    sampler = Sampler(seed=0)
    logits = torch.tensor([[5.0, 2.0, 4.0, 1.0]])
    draws = {sampler.sample(logits, [row])[0].token_id for _ in range(200)}
    assert draws == {1, 3}


def test_min_p_drops_tokens_below_min_p_times_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).tolist()
    draws = _draw_many(logits, SamplingParams(temperature=1.0, min_p=0.35))  # threshold 0.175
    assert set(draws) == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 0 (seen, 2.0 -> 1.0) loses to token 1 (unseen, 1.9)
    assert (
        sampler.sample(torch.tensor([[2.0, 1.9, 0.0]]), [_row(params, prompt=[0])])[0].token_id == 1
    )
    # seen negative logit gets more negative: token 2 (-0.1 -> -0.2) loses to token 1 (-0.15)
    logits = torch.tensor([[-5.0, -0.15, -0.1]])
    assert sampler.sample(logits, [_row(params, prompt=[2])])[0].token_id == 1


def test_frequency_and_presence_penalties_count_output_tokens_only():
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert (
        sampler.sample(logits, [_row(frequency, prompt=[0, 0, 0], output=[0])])[0].token_id == 0
    )  # 1.7 > 1.5
    assert sampler.sample(logits, [_row(frequency, output=[0, 0])])[0].token_id == 1  # 1.4 < 1.5
    presence = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert sampler.sample(logits, [_row(presence, output=[0])])[0].token_id == 1  # 1.4 < 1.5


def test_logit_bias_shifts_the_chosen_token():
    params = SamplingParams(temperature=0.0, logit_bias={3: 10.0, 0: -100.0})
    assert Sampler().sample(torch.tensor([[5.0, 1.0, 0.0, -4.0]]), [_row(params)])[0].token_id == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_vanishing_repetition_penalty_keeps_masked_tokens_out(temperature):
    # A grammar's mask leaves -inf; the penalty multiplies seen tokens' negative logits, and a
    # penalty that is 0 in float32 made -inf NaN, which sampling then picked.
    logits = torch.tensor([[float("-inf"), 2.0, -1.0, float("-inf")]])
    params = SamplingParams(temperature=temperature, repetition_penalty=1e-300)
    for seed in range(20):
        token = Sampler(seed=seed).sample(logits.clone(), [_row(params, prompt=(0, 1, 2, 3))])[0]
        assert token.token_id in (1, 2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_allowed_token_ids_are_sampled(temperature):
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.5, 7.0]])  # the allowed ones are not the best
    params = SamplingParams(temperature=temperature, allowed_token_ids=(1, 3), logprobs=2)
    sampled = {Sampler(seed=s).sample(logits.clone(), [_row(params)])[0] for s in range(30)}
    assert {result.token_id for result in sampled} <= {1, 3}
    if temperature == 0.0:
        assert {result.token_id for result in sampled} == {1}


def test_a_bad_words_last_token_is_banned_only_where_the_output_ends_with_the_rest():
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])  # 7 is the best
    params = SamplingParams(temperature=0.0, bad_words_token_ids=((5, 7), (3,)))
    assert Sampler().sample(logits.clone(), [_row(params, output=(2, 5))])[0].token_id == 1
    assert Sampler().sample(logits.clone(), [_row(params, output=(5, 2))])[0].token_id == 7
    assert Sampler().sample(logits.clone(), [_row(params)])[0].token_id == 7
    logits[0, 3] = 20.0  # a one-token bad word is never sampled
    assert Sampler().sample(logits.clone(), [_row(params)])[0].token_id == 7


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_exclusions_leave_no_token_fails_with_that_reason(temperature):
    # allowed (3, 5); the output ends with 4, which starts a bad word ending in 5; 3 is banned
    params = SamplingParams(
        temperature=temperature, allowed_token_ids=(3, 5), bad_words_token_ids=((3,), (4, 5))
    )
    rows = [_row(params, output=(4,)), _row(SamplingParams(temperature=0.0))]
    failed, other = Sampler().sample(torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 2), rows)
    assert isinstance(failed, NoTokenLeftError) and "bad_words" in str(failed)
    assert other.token_id == 5  # the batch goes on


def test_banned_tokens_below_min_tokens_are_never_sampled():
    logits = torch.tensor([[0.0, 0.0, 50.0, 0.0]])  # EOS (2) is by far the best
    greedy = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8)
    assert Sampler().sample(logits, [_row(greedy, banned=[EOS])])[0].token_id != EOS
    draws = _draw_many([0.0, 0.0, 50.0, 0.0], SamplingParams(temperature=1.0), num_draws=1)
    assert draws == [EOS]
    sampled = {
        Sampler(seed=s)
        .sample(logits, [_row(SamplingParams(temperature=1.0), banned=[EOS])])[0]
        .token_id
        for s in range(20)
    }
    assert EOS not in sampled


def test_logprobs_are_the_log_softmax_of_the_raw_logits_with_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.0, logprobs=3)
    result = Sampler().sample(logits, [_row(params)])[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert result.token_id == 1
    assert result.logprob.token_id == 1 and result.logprob.logprob == pytest.approx(
        float(expected[1]), abs=1e-6
    )
    ids = [token_id for token_id, _ in result.logprob.top_logprobs]
    assert ids == [1, 2, 0]
    for token_id, value in result.logprob.top_logprobs:
        assert value == pytest.approx(float(expected[token_id]), abs=1e-6)
    only_chosen = Sampler().sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=0))])[0]
    assert only_chosen.logprob.top_logprobs == ()


def test_a_greedy_token_tied_for_the_top_is_listed_first_among_its_alternatives():
    """bfloat16 logits tie often: greedy takes the lowest id, and top_logprobs must agree."""
    logits = torch.full((1, 64), -5.0)
    logits[0, [41, 9, 30]] = 2.0  # three-way tie for the top
    logits[0, 5] = 1.0
    result = Sampler().sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=4))])[0]
    assert result.token_id == 9
    assert [token_id for token_id, _ in result.logprob.top_logprobs] == [9, 30, 41, 5]


def test_min_tokens_does_not_ban_the_only_token_a_grammar_still_allows():
    """A constraint satisfied before min_tokens leaves only EOS: ending beats an empty step."""
    logits = torch.full((1, 16), float("-inf"))
    logits[0, EOS] = 0.5  # what the grammar's mask left
    row = _row(SamplingParams(temperature=0.0, min_tokens=4), banned=[EOS])
    assert Sampler().sample(logits, [row])[0].token_id == EOS
    logits[0, 7] = 0.1  # another token allowed: min_tokens bans EOS as usual
    assert Sampler().sample(logits, [row])[0].token_id == 7


def test_one_failing_row_does_not_fail_the_others():
    logits = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    rows = [
        _row(SamplingParams(temperature=0.0)),
        _row(penalised, prompt=[10**6]),  # a token id outside the vocabulary: this row raises
        _row(SamplingParams(temperature=0.7), seed=1),
    ]
    results = Sampler().sample(logits, rows)
    assert results[0].token_id == 1
    assert isinstance(results[1], Exception)
    assert not isinstance(results[2], Exception) and 0 <= results[2].token_id < 3


def test_seeded_rows_draw_the_same_token_regardless_of_neighbours():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0)
    alone = [Sampler(seed=1).sample(logits, [_row(params, seed=9)])[0].token_id for _ in range(3)]
    others = torch.randn(3, 50)
    batch = torch.cat([others[:2], logits, others[2:]])
    rows = [_row(params), _row(params), _row(params, seed=9), _row(params, seed=4)]
    assert Sampler(seed=5).sample(batch, rows)[2].token_id == alone[0]


# ---- engine-level ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("llama-gqa", default_tokenizer, seed=1)


def _generate_alone(loaded, prompt, params, **settings) -> list[int]:
    engine = make_engine(loaded, **settings)
    engine.add_request("alone", prompt, params)
    return run_to_completion(engine).token_ids["alone"]


def test_seeded_request_gives_the_same_output_alone_and_amid_other_requests(tiny_loaded):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = [17, 300, 42, 999, 8, 64, 7]
    alone = _generate_alone(tiny_loaded, prompt, params, block_size=4)
    assert alone == _generate_alone(tiny_loaded, prompt, params, block_size=4)
    engine = make_engine(tiny_loaded, block_size=4, max_num_batched_tokens=20)
    engine.add_request(
        "long", list(range(3, 60)), SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    )
    engine.add_request(
        "other-seed",
        prompt,
        SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True),
    )
    engine.add_request("seeded", prompt, params)
    engine.add_request(
        "unseeded", prompt[:3], SamplingParams(temperature=1.5, max_tokens=5, ignore_eos=True)
    )
    engine.add_request("twin", prompt, params)
    run = run_to_completion(engine)
    assert run.token_ids["seeded"] == alone
    assert run.token_ids["twin"] == alone
    assert run.token_ids["other-seed"] != alone[:10]


def test_min_tokens_bans_eos_until_reached(tiny_loaded):
    params = SamplingParams(temperature=0.0, min_tokens=5, max_tokens=10, logit_bias={EOS: 100.0})
    engine = make_engine(tiny_loaded, block_size=4)
    assert engine.eos_token_ids == [EOS]
    engine.add_request("r", [5, 6, 7], params)
    run = run_to_completion(engine)
    assert run.token_ids["r"][:5].count(EOS) == 0
    assert run.token_ids["r"][5] == EOS and len(run.token_ids["r"]) == 6
    assert run.finish_reasons["r"] == "stop"


def test_other_generation_config_eos_ids_end_a_choice_as_stop_tokens(tiny_loaded, monkeypatch):
    # As vLLM: the tokenizer's EOS is the EOS (no stop_reason), the generation config's others
    # are stop tokens (their id is the stop_reason), whatever order the config lists them in.
    monkeypatch.setattr(tiny_loaded.model.generation_config, "eos_token_id", [7, EOS])
    engine = make_engine(tiny_loaded, block_size=4)
    assert engine.eos_token_ids == [EOS, 7]
    for request_id, token_id in (("eos", EOS), ("other", 7)):
        params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={token_id: 100.0})
        engine.add_request(request_id, [5, 6], params)
    run = run_to_completion(engine)
    assert run.token_ids == {"eos": [EOS], "other": [7]}
    assert run.stop_reasons == {"eos": None, "other": 7}


def test_bad_words_change_a_greedy_output_where_it_would_complete_one(tiny_loaded):
    prompt = [5, 6, 7]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    free = _generate_alone(tiny_loaded, prompt, greedy, block_size=4)
    bad = (tuple(free[1:3]),)  # the output's second and third tokens, as one bad word
    banned = dataclasses.replace(greedy, bad_words_token_ids=bad)
    output = _generate_alone(tiny_loaded, prompt, banned, block_size=4)
    assert output[:2] == free[:2] and output[2] != free[2]
    assert all(tuple(output[i : i + 2]) != bad[0] for i in range(len(output) - 1))


def test_one_token_bad_words_that_ban_every_allowed_id_are_refused_up_front(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4)
    params = SamplingParams(allowed_token_ids=(11, 29), bad_words_token_ids=((29,), (11,)))
    with pytest.raises(InvalidRequestError) as refused:
        engine.validate_request("r", [5, 6], params, 0.0, 0)
    assert refused.value.param == "bad_words"
    allowed_one = dataclasses.replace(params, bad_words_token_ids=((29,), (4, 11)))
    engine.validate_request("r", [5, 6], allowed_one, 0.0, 0)  # 11 is left (not after a 4)


def test_allowed_token_ids_hold_for_every_token_of_a_request(tiny_loaded):
    allowed = (11, 29, 301)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed)
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request("r", [5, 6, 7], params)
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=1.0, seed=3, max_tokens=12))
    run = run_to_completion(engine)
    assert len(run.token_ids["r"]) == 12 and set(run.token_ids["r"]) <= set(allowed)
    assert not set(run.token_ids["free"]) <= set(allowed)  # the other row was not restricted


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_token_ends_the_output_without_its_text_unless_asked(
    tiny_loaded, default_tokenizer, include_stop
):
    stop_id = default_tokenizer.encode(" the")[0]  # an ordinary word, with text of its own
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        min_tokens=2,
        stop_token_ids=(stop_id,),
        include_stop_str_in_output=include_stop,
        logit_bias={stop_id: 100.0},  # the best token once min_tokens no longer bans it
    )
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request("r", [5, 6, 7], params)
    run = run_to_completion(engine)
    tokens = run.token_ids["r"]
    assert len(tokens) == 3 and tokens[2] == stop_id and stop_id not in tokens[:2]
    assert run.finish_reasons["r"] == "stop" and run.stop_reasons["r"] == stop_id
    expected = default_tokenizer.decode(tokens if include_stop else tokens[:2])
    assert run.texts["r"] == expected


@pytest.mark.parametrize("listed", [False, True])
def test_eos_is_no_stop_reason_even_when_listed_in_stop_token_ids(tiny_loaded, listed):
    engine = make_engine(tiny_loaded, block_size=4)
    eos = engine.tokenizer.eos_token_id
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        stop_token_ids=(eos,) if listed else (),
        logit_bias={eos: 100.0},
    )
    engine.add_request("r", [5, 6, 7], params)
    run = run_to_completion(engine)
    assert run.token_ids["r"] == [eos] and run.finish_reasons["r"] == "stop"
    assert run.stop_reasons["r"] is None  # as vLLM: EOS has precedence over the listed id


def test_n4_shares_prompt_blocks_then_diverges_by_copy_on_write_and_frees_everything(tiny_loaded):
    prompt = [
        int(t) for t in torch.randint(3, 1000, (21,), generator=torch.Generator().manual_seed(5))
    ]
    params = SamplingParams(n=4, temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)
    engine = make_engine(tiny_loaded, block_size=4, num_kv_blocks=64)
    run = EngineRun()
    record_plans(engine, run)
    engine.add_request("fan", prompt, params)
    run_to_completion(engine, run)
    assert max(run.max_ref_counts) == 4, "the four choices never shared the prompt's full blocks"
    assert any(plan.block_copies for plan in run.plans), "no copy-on-write happened"
    outputs = [run.token_ids["fan"], *(run.token_ids[("fan", i)] for i in range(1, 4))]
    assert all(len(output) == 12 for output in outputs)
    assert len({tuple(output) for output in outputs}) == 4, "the choices did not diverge"
    # choice i samples with seed + i: each must equal that seed run on its own (no KV corruption)
    for index, output in enumerate(outputs):
        alone = _generate_alone(
            tiny_loaded,
            prompt,
            SamplingParams(temperature=1.0, seed=77 + index, max_tokens=12, ignore_eos=True),
            block_size=4,
        )
        assert output == alone, f"choice {index} differs from seed {77 + index} run alone"


# ---- Logits dtype: argmax-only steps skip widening ----------------------------------------------


def test_only_steps_that_take_nothing_but_argmaxes_skip_float32():
    greedy = _row(SamplingParams(temperature=0))
    assert takes_only_argmax([greedy, greedy], [None, None], num_logits_rows=2)
    assert not takes_only_argmax([greedy], [object()], num_logits_rows=1)  # a grammar masks
    assert not takes_only_argmax([greedy], [None], num_logits_rows=3)  # draft / prompt rows
    with_logprobs = _row(SamplingParams(temperature=0, logprobs=2))
    assert not takes_only_argmax([greedy, with_logprobs], [None, None], num_logits_rows=2)
    sampled = _row(SamplingParams(temperature=0.7))
    assert not takes_only_argmax([sampled], [None], num_logits_rows=1)


def test_a_bfloat16_engine_samples_greedy_steps_from_bfloat16_logits(default_tokenizer):
    loaded = make_tiny_model("llama-gqa", default_tokenizer, seed=1)
    loaded.model.to(torch.bfloat16)
    engine = make_engine(loaded, dtype="bfloat16")
    dtypes: list[tuple[torch.dtype, bool]] = []
    sample = engine.sampler.sample

    def spy(logits, rows):
        dtypes.append((logits.dtype, any(row.params.logprobs for row in rows)))
        return sample(logits, rows)

    engine.sampler.sample = spy
    prompt = [5, 9, 14, 3]
    engine.add_request("greedy", prompt, SamplingParams(temperature=0, max_tokens=3))
    greedy_tokens = run_to_completion(engine).token_ids["greedy"]
    engine.add_request("logprobs", prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=1))
    logprob_tokens = run_to_completion(engine).token_ids["logprobs"]
    assert dtypes == [(torch.bfloat16, False)] * 3 + [(torch.float32, True)] * 3
    assert greedy_tokens == logprob_tokens  # argmax of bfloat16 == argmax of its float32 upcast
