"""Edge cases of a request's identity, ending and accounting, on a tiny random model: choice ids
of an n > 1 request that collide with another request's id are refused before anything is queued;
a stop string completed by the last allowed token ends the choice as "stop", not "length"; an n > 1
request reports its earliest choice's queue and prefill times; prompt tokens count per choice once
prefilled, never for a request aborted before its prompt ran."""

from __future__ import annotations

import pytest

from pagedserve.configs import SamplingParams
from pagedserve.engine.errors import InvalidRequestError
from tests.engine.conftest import greedy_params, make_engine, make_tiny_model, run_to_completion

PROMPT = [17, 300, 42, 999, 8, 64, 7]


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("llama-gqa", default_tokenizer, seed=1)


def test_a_request_id_in_use_is_refused_and_queues_nothing(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request("a", PROMPT, greedy_params(4, n=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", PROMPT, greedy_params(4))
    run = run_to_completion(engine)  # also checks that every block is free at the end
    assert set(run.finish_reasons) == {"a", ("a", 1)}


@pytest.mark.parametrize(("first", "second"), [(("a#1", 1), ("a", 2)), (("a", 2), ("a#1", 1))])
def test_a_request_id_that_looks_like_another_s_sequence_id_is_served_on_its_own(
    tiny_loaded, first, second
):
    # Sequence ids are "<request id>#<index>" for every choice: distinct requests never share one.
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request(first[0], PROMPT, greedy_params(4, n=first[1]))
    engine.add_request(second[0], PROMPT, greedy_params(4, n=second[1]))
    run = run_to_completion(engine)
    assert set(run.finish_reasons) == {"a", ("a", 1), "a#1"}


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_as_stop(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request("free", PROMPT, greedy_params(6))
    free = run_to_completion(engine)
    tokenizer = engine.tokenizer
    before_last = tokenizer.decode(free.token_ids["free"][:5])
    last_piece = tokenizer.decode(free.token_ids["free"])[len(before_last) :]
    assert last_piece.strip() and last_piece not in before_last, "pick another prompt"

    engine.add_request("stopped", PROMPT, greedy_params(6, stop=(last_piece,)))
    run = run_to_completion(engine)
    assert run.token_ids["stopped"] == free.token_ids["free"]
    assert run.finish_reasons["stopped"] == "stop"
    assert run.stop_reasons == {"stopped": last_piece}  # vLLM's stop_reason: the string matched
    assert free.stop_reasons == {"free": None}  # finished by length
    assert run.texts["stopped"] == free.texts["free"][: len(free.texts["free"]) - len(last_piece)]


def test_an_n3_request_reports_its_earliest_choice_s_queue_and_prefill_times(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request(
        "r", PROMPT, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    )
    choices = [engine.scheduler.requests[f"r#{index}"] for index in range(3)]
    timings = []
    while engine.has_unfinished_requests():
        timings += [delta.timings for delta in engine.step() if delta.timings is not None]
    (request_timings,) = timings  # sent once, with the request's last final delta
    # Forked choices are scheduled after the parent's prompt: the parent's times are the request's.
    assert request_timings.first_scheduled_time == min(c.first_scheduled_time for c in choices)
    assert request_timings.first_token_time == min(c.first_token_time for c in choices)


def test_prompt_tokens_are_counted_per_choice_once_prefilled_and_not_for_aborted_requests(
    tiny_loaded,
):
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request("pair", PROMPT, SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    engine.add_request("gone", PROMPT[:3], greedy_params(2))
    engine.abort_request("gone")  # before its prompt ran
    assert engine.stats().num_prompt_tokens == 0
    run_to_completion(engine)
    assert engine.stats().num_prompt_tokens == 2 * len(PROMPT)


@pytest.mark.parametrize(("max_logprobs", "allowed"), [(20, 20), (30, 30), (-1, None)])
def test_max_logprobs_caps_the_alternatives_a_request_may_ask_for(
    tiny_loaded, max_logprobs, allowed
):
    """vLLM's --max-logprobs: at most that many alternatives per token, sampled or prompt (-1:
    the vocabulary); a request over it is refused whole, nothing queued."""
    engine = make_engine(tiny_loaded, max_logprobs=max_logprobs)
    allowed = allowed if allowed is not None else engine.vocab_size
    engine.add_request("at-cap", [5, 6, 7], greedy_params(max_tokens=2, logprobs=allowed))
    run = run_to_completion(engine)
    assert run.finish_reasons["at-cap"] == "length"
    for field in ("logprobs", "prompt_logprobs"):
        params = greedy_params(max_tokens=2, **{field: allowed + 1})
        with pytest.raises(InvalidRequestError, match=f"\\({allowed}, --max-logprobs\\)") as error:
            engine.add_request(f"over-{field}", [5, 6, 7], params)
        assert error.value.param == field
    assert not engine.has_unfinished_requests()


def test_prefilled_tokens_count_what_was_computed_not_prefix_cache_hits(tiny_loaded):
    """The stats line's prompt throughput (server/stats_log.py) reads this counter: prompt
    tokens computed. A prompt served again from the prefix cache computes only its uncached tail
    (a whole-block hit leaves the last token to compute), and an n=2 request computes its prompt
    once plus its second choice's last token."""
    engine = make_engine(tiny_loaded, block_size=4, enable_prefix_caching=True)
    prompt = list(range(5, 45))  # 40 tokens: 10 blocks
    engine.add_request("first", prompt, greedy_params(max_tokens=2))
    run_to_completion(engine)
    assert engine.stats().num_prefilled_tokens == 40
    engine.add_request("again", prompt, greedy_params(max_tokens=2))
    run_to_completion(engine)
    again = engine.stats().num_prefilled_tokens - 40
    assert 1 <= again <= 4 and engine.stats().num_prompt_tokens == 80
    engine.add_request("pair", list(range(50, 70)), greedy_params(max_tokens=2, n=2))
    run_to_completion(engine)
    assert engine.stats().num_prefilled_tokens - 40 - again == 20 + 1
