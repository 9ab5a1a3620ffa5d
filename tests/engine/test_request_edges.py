"""Edge cases of a request's identity and ending, on a tiny random model: choice ids of an n > 1
request that collide with another request's id are refused before anything is queued, and a stop
string completed by the last allowed token ends the choice as "stop", not "length"."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from tests.engine.conftest import greedy_params, make_engine, make_tiny_model, run_to_completion

PROMPT = [17, 300, 42, 999, 8, 64, 7]


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("llama-gqa", default_tokenizer, seed=1)


@pytest.mark.parametrize(("first", "second"), [
    (("a#1", 1), ("a", 2)),  # a choice id of the second equals the first's request id
    (("a", 2), ("a#1", 1)),  # the second's request id equals a choice id of the first
])
def test_a_request_whose_choice_ids_collide_is_refused_and_queues_nothing(tiny_loaded, first, second):
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request(first[0], PROMPT, greedy_params(4, n=first[1]))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(second[0], PROMPT, greedy_params(4, n=second[1]))
    run = run_to_completion(engine)  # also checks that every block is free at the end
    assert set(run.finish_reasons) == {first[0]} | {(first[0], i) for i in range(1, first[1])}


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_as_stop(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request("free", PROMPT, greedy_params(6))
    free = run_to_completion(engine)
    tokenizer = engine.tokenizer
    before_last = tokenizer.decode(free.token_ids["free"][:5])
    last_piece = tokenizer.decode(free.token_ids["free"])[len(before_last):]
    assert last_piece.strip() and last_piece not in before_last, "pick another prompt"

    engine.add_request("stopped", PROMPT, greedy_params(6, stop=(last_piece,)))
    run = run_to_completion(engine)
    assert run.token_ids["stopped"] == free.token_ids["free"]
    assert run.finish_reasons["stopped"] == "stop"
    assert run.texts["stopped"] == free.texts["free"][: len(free.texts["free"]) - len(last_piece)]

