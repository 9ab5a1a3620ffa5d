"""Beam search: at the HTTP layer (fake engine), the fields it would not honour are 400s before
anything is queued and its beams come back as choices, best first, with their token usage; the
search itself over a table of next-token logprobs (EOS, length penalty, ignore_eos, a failing or
aborted step). tests/server/test_e2e_openai.py checks it against a search written out over
Hugging Face's model."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.errors import RequestFailedError
from pagedserve.engine.outputs import RequestDelta, TokenLogprob
from pagedserve.server.beam_search import BeamSearchParams, beam_search
from tests.server.conftest import ByteTokenizer, FakeEngine

COMPLETION = {"prompt": "ab", "max_tokens": 3, "use_beam_search": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "use_beam_search": True}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"temperature": 0.7}, "temperature"),  # 0 and 1 rank by the model's own logprobs
        ({"top_p": 0.9}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"min_p": 0.1}, "min_p"),
        ({"max_tokens": 0, "echo": True}, "max_tokens"),
        ({"stop": ["x"]}, "stop"),
        ({"stop_token_ids": [5]}, "stop_token_ids"),
        ({"stop_regex": "x"}, "stop_regex"),
        ({"min_tokens": 1}, "min_tokens"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logit_bias": {"97": 1.0}}, "logit_bias"),
        ({"bad_words": ["a"]}, "bad_words"),
        ({"n": 11}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_what_beam_search_would_not_honour_is_a_400(client, engine, route, fields, param):
    body = COMPLETION if route == "/v1/completions" else CHAT
    if route == "/v1/completions" and fields.get("logprobs") is True:
        fields = {"logprobs": 0}  # completions' logprobs is a count; 0 still asks
    if route == "/v1/chat/completions" and "echo" in fields:
        fields = {"max_tokens": 0}
    response = client.post(route, json={**body, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


def test_beams_come_back_as_choices_best_first_with_their_usage(client, engine: FakeEngine):
    # The fake's next token is always "a" (logprob -0.5) with "z" (-1.5) the runner-up.
    response = client.post("/v1/completions", json={**COMPLETION, "n": 2, "temperature": 1.0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [choice["text"] for choice in body["choices"]] == ["aaa", "aaz"]
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert {choice["finish_reason"] for choice in body["choices"]} == {"length"}
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == 2
    # Three steps, each one request per live beam: 1, then 2, then 2; one token each.
    assert [len(tokens) - 2 for _, tokens, _ in engine.requests] == [0, 1, 1, 2, 2]
    assert all(params.max_tokens == 1 and params.logprobs == 4 for *_, params in engine.requests)


def test_chat_beam_search_answers_with_one_message_per_beam(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()
    assert [choice["message"]["content"] for choice in body["choices"]] == ["aaa", "aaz"]


EOS = 0


class TableEngine:
    """Next-token logprobs by the last token of the prompt, best first."""

    tokenizer = ByteTokenizer()
    eos_token_ids = (EOS,)

    def __init__(self, table: dict[int, list[tuple[int, float]]]) -> None:
        self.table = table

    async def generate(self, token_ids, params, request_id, priority=0):
        top = tuple(self.table[token_ids[-1]][: params.logprobs])
        entry = TokenLogprob(top[0][0], top[0][1], top)
        yield RequestDelta(request_id, 0, (top[0][0],), "", (entry,), len(token_ids), 1, True)


async def _search(table, **params) -> list[tuple[str, tuple[int, ...], str]]:
    settings = {"width": 2, "max_tokens": 3, **params}
    deltas = beam_search(TableEngine(table), [ord(">")], BeamSearchParams(**settings), "r")
    return [(d.new_text, d.new_token_ids, d.finish_reason) async for d in deltas]


A, B, C = ord("a"), ord("b"), ord("c")
# ">" -> a (-0.15) or b (-0.2); after a, EOS is likely; after b, c then c.
TABLE = {
    ord(">"): [(A, -0.15), (B, -0.2), (C, -5.0), (EOS, -6.0)],
    A: [(EOS, -0.1), (A, -3.0), (B, -4.0), (C, -5.0)],
    B: [(C, -0.05), (A, -2.0), (B, -3.0), (EOS, -4.0)],
    C: [(C, -0.05), (EOS, -0.5), (A, -3.0), (B, -4.0)],
    EOS: [(C, -0.1), (A, -3.0), (B, -4.0), (EOS, -5.0)],  # read only with ignore_eos
}


@pytest.mark.anyio
async def test_a_beam_ending_with_eos_is_set_aside_finished_and_ranked_by_length_penalty():
    # "a"+EOS: -0.25 over 2 tokens with the prompt's one (the EOS not counted, as vLLM's);
    # "bcc": -0.3 over 4. Length penalty 1 ranks by mean logprob.
    assert await _search(TABLE) == [
        ("bcc", (B, C, C), "length"),
        ("a", (A,), "stop"),  # the EOS ends it and, as in vLLM, is neither text nor token id
    ]
    # Without a length penalty the plain cumulative logprob decides.
    assert [text for text, *_ in await _search(TABLE, length_penalty=0.0)] == ["a", "bcc"]


@pytest.mark.anyio
async def test_ignore_eos_keeps_every_beam_going():
    # "a", then EOS as an ordinary token (-0.1), then "c": -0.35, ahead of "bb..." beams.
    assert await _search(TABLE, ignore_eos=True, width=1) == [("a\x00c", (A, EOS, C), "length")]


@pytest.mark.anyio
async def test_include_stop_str_in_output_keeps_the_eos_text():
    beams = await _search(TABLE, include_stop_str_in_output=True)
    assert beams[1] == ("a\x00", (A, EOS), "stop")


@pytest.mark.anyio
async def test_a_huge_length_penalty_ranks_without_overflowing():
    # cum / length ** 2000 overflows a float; the ranking is taken in log space.
    assert [text for text, *_ in await _search(TABLE, length_penalty=2000.0)][0] == "bcc"
    # Negative: the shortest wins, here the beam that ended at once (EOS first, -6.0).
    assert (await _search(TABLE, length_penalty=-2000.0))[0] == ("", (), "stop")


class FailingEngine(TableEngine):
    """The second beam's request of the second step fails; the others wait until cancelled."""

    def __init__(self, table, finish_reason: str) -> None:
        super().__init__(table)
        self.finish_reason, self.open, self.closed = finish_reason, set(), set()

    async def generate(self, token_ids, params, request_id, priority=0):
        self.open.add(request_id)
        try:
            if request_id.endswith("beam-1-1"):
                yield RequestDelta(
                    request_id, 0, (), "", None, 1, 0, True, self.finish_reason, "boom"
                )
                return
            if "beam-1" in request_id:
                await asyncio.sleep(3600)  # still running when its sibling fails
            async for delta in super().generate(token_ids, params, request_id):
                yield delta
        finally:
            self.closed.add(request_id)


@pytest.mark.anyio
async def test_a_failed_step_cancels_its_other_requests_and_fails_the_search():
    engine = FailingEngine(TABLE, "error")
    deltas = beam_search(engine, [ord(">")], BeamSearchParams(2, 3), "r")
    with pytest.raises(RequestFailedError, match="boom"):
        [delta async for delta in deltas]
    assert engine.open == engine.closed  # nothing left running in the engine


@pytest.mark.anyio
async def test_an_aborted_step_ends_the_search_with_the_beams_so_far():
    engine = FailingEngine({**TABLE}, "abort")
    engine.generate = _no_wait(engine)  # the sibling answers at once this time
    deltas = beam_search(engine, [ord(">")], BeamSearchParams(2, 3), "r")
    results = [(d.new_text, d.finish_reason) async for d in deltas]
    assert results == [("a", "abort"), ("b", "abort")]  # one token each: step 2 was aborted


def _no_wait(engine: FailingEngine):
    async def generate(token_ids, params, request_id, priority=0):
        if request_id.endswith("beam-1-1"):
            yield RequestDelta(request_id, 0, (), "", None, 1, 0, True, "abort")
            return
        async for delta in TableEngine.generate(engine, token_ids, params, request_id):
            yield delta

    return generate


@pytest.mark.anyio
async def test_an_abort_at_the_first_step_returns_n_aborted_choices():
    class AbortingEngine(TableEngine):
        async def generate(self, token_ids, params, request_id, priority=0):
            yield RequestDelta(request_id, 0, (), "", None, 1, 0, True, "abort")

    deltas = beam_search(AbortingEngine(TABLE), [ord(">")], BeamSearchParams(2, 3), "r")
    assert [(d.index, d.new_text, d.finish_reason) async for d in deltas] == [
        (0, "", "abort"),
        (1, "", "abort"),
    ]
