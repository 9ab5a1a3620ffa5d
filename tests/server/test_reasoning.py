"""Reasoning parsers (`--reasoning-parser`): a thinking model's <think> part comes back apart from
its answer, in every chunk split, streamed and whole, before the tool parser reads the answer."""

from __future__ import annotations

import pytest

from pagedserve.configs import ThinkBlock
from pagedserve.server.reasoning import ReasoningSplitter, opens_in_reasoning
from tests.server.conftest import ByteTokenizer, FakeEngine, sse_json

USER = [{"role": "user", "content": "hi"}]


def _split(text: str, in_reasoning: bool, size: int) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(in_reasoning), "", ""
    for start in range(0, len(text), size):
        piece = splitter.feed(text[start : start + size])
        reasoning, content = reasoning + piece[0], content + piece[1]
    tail = splitter.finish()
    return reasoning + tail[0], content + tail[1]


@pytest.mark.parametrize(
    ("text", "in_reasoning", "expected"),
    [
        ("<think>\nplan\n</think>\n\nAnswer", False, ("\nplan\n", "\n\nAnswer")),
        ("  <think>plan</think>Answer", False, ("plan", "Answer")),
        ("plan</think>\n\nAnswer", True, ("plan", "\n\nAnswer")),  # the prompt opened it
        ("<think>plan</think>Answer", True, ("plan", "Answer")),  # and the model opened it too
        ("Answer only", False, ("", "Answer only")),
        ("Answer with </think> in it", False, ("", "Answer with </think> in it")),
        ("never closed", True, ("never closed", "")),
        ("<think>never closed</thi", False, ("never closed</thi", "")),
        ("<thin", False, ("", "<thin")),  # a tag that never became one is text
        ("a < b <think>", False, ("", "a < b <think>")),  # only at the start
    ],
)
def test_reasoning_is_split_from_the_answer_in_every_chunk_split(text, in_reasoning, expected):
    for size in (1, 2, 3, 5, len(text)):
        assert _split(text, in_reasoning, size) == expected, size


def test_where_a_reply_starts():
    assert opens_in_reasoning("deepseek_r1", "<|User|>hi<|Assistant|>")
    # ... unless the prompt closed the block (thinking off) or a prefill did: the reply is the
    # answer (and an output constraint applies from its first token).
    assert not opens_in_reasoning("deepseek_r1", "<|Assistant|><think>\n\n</think>\n\n")
    assert not opens_in_reasoning("deepseek_r1", "x", prefill="<think>a</think>b")
    assert opens_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")  # left open
    assert not opens_in_reasoning("qwen3", "<|im_start|>assistant\n")
    assert not opens_in_reasoning("qwen3", "assistant\n<think>\n\n</think>\n\n")  # thinking off
    # A user's own "<think>" is not the template opening a block.
    assert not opens_in_reasoning("qwen3", "user\nWhat does <think> do?\nassistant\n")


@pytest.fixture
def thinking_client(client_with, engine: FakeEngine):
    engine.script = "<think>Two words.</think>\n\nHello there"
    engine.max_model_len = 4096
    return client_with(reasoning_parser="qwen3")


def _chat(client, **fields):
    body = {"messages": USER, "max_tokens": 64, **fields}
    return client.post("/v1/chat/completions", json=body)


def test_the_reasoning_comes_back_apart_from_the_answer(thinking_client):
    message = _chat(thinking_client).json()["choices"][0]["message"]
    assert message["reasoning"] == "Two words." and message["content"] == "\n\nHello there"


def test_streamed_reasoning_comes_in_its_own_delta_field(thinking_client):
    text = _chat(thinking_client, stream=True).text
    events = sse_json(text)
    deltas = [event["choices"][0]["delta"] for event in events]
    assert "".join(delta.get("reasoning", "") for delta in deltas) == "Two words."
    assert "".join(delta.get("content", "") for delta in deltas) == "\n\nHello there"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning" not in delta for delta in deltas[first_content:])


def test_include_reasoning_false_leaves_it_out_and_refuses_what_would_spell_it(thinking_client):
    message = _chat(thinking_client, include_reasoning=False).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nHello there"}
    text = _chat(thinking_client, include_reasoning=False, stream=True).text
    assert "Two words" not in text and '"reasoning"' not in text
    events = sse_json(text)
    content = "".join(event["choices"][0]["delta"].get("content", "") for event in events)
    assert content == "\n\nHello there"
    for field in ({"logprobs": True}, {"return_token_ids": True}):
        response = _chat(thinking_client, include_reasoning=False, **field)
        assert response.status_code == 400 and response.json()["error"]["param"] in field


def test_without_a_parser_the_reasoning_stays_in_the_content(client, engine: FakeEngine):
    engine.script = "<think>Two words.</think>Hello"
    engine.max_model_len = 4096
    message = _chat(client).json()["choices"][0]["message"]
    assert message["content"] == "<think>Two words.</think>Hello" and "reasoning" not in message


def test_the_tool_parser_reads_the_answer_after_the_reasoning(client_with, engine: FakeEngine):
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    engine.script = f"<think>I should call f.</think>\n{call}"
    engine.max_model_len = 4096
    client = client_with(
        reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    choice = _chat(client, tools=tools, max_tokens=200).json()["choices"][0]
    assert choice["message"]["reasoning"] == "I should call f."
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# Requests under an output constraint, with a reply each (the grammar would allow it).
CONSTRAINED = [
    (
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        '{"city": "Paris"}',
    ),
    ({"tools": TOOLS, "tool_choice": "required"}, '[{"name": "get_weather", "arguments": {}}]'),
    ({"response_format": {"type": "json_object"}}, '{"a": 1}'),
]
CONSTRAINED_IDS = ["named", "required", "json_object"]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("fields", "script"), CONSTRAINED, ids=CONSTRAINED_IDS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_reply_is_not_taken_for_reasoning(
    client_with, engine: FakeEngine, parser, fields, script, stream
):
    # Without one-token think tags the grammar forces the reply's shape from its first token:
    # there is no think block in it, even where the parser would otherwise start inside one
    # (deepseek_r1).
    engine.script, engine.max_model_len = script, 4096
    client = client_with(reasoning_parser=parser)
    response = _chat(client, stream=stream, **fields)
    assert response.status_code == 200, response.text
    assert '"reasoning"' not in response.text
    assert engine.requests[-1][2].structured_outputs.think is None
    if "tools" in fields:
        assert "get_weather" in response.text and "tool_calls" in response.text
        assert '"finish_reason":"tool_calls"' in response.text.replace(" ", "")
    elif not stream:
        assert response.json()["choices"][0]["message"]["content"] == script


def test_an_assistant_prefill_inside_a_think_block_continues_the_reasoning():
    assert opens_in_reasoning("qwen3", "assistant\n<think>\nhmm", prefill="<think>\nhmm")
    assert not opens_in_reasoning(
        "qwen3", "assistant\n<think>a</think>b", prefill="<think>a</think>b"
    )


def test_a_constrained_reply_may_come_with_logprobs_when_reasoning_is_hidden(client_with, engine):
    engine.script, engine.max_model_len = '{"a": 1}', 4096
    client = client_with(reasoning_parser="deepseek_r1")
    fields = {"response_format": {"type": "json_object"}, "include_reasoning": False}
    response = _chat(client, logprobs=True, **fields)
    assert response.status_code == 200, response.text  # nothing is split, nothing hidden


def test_include_reasoning_false_needs_a_reasoning_parser(client):
    # Without one the server cannot tell the reasoning apart: refused, not answered whole.
    response = _chat(client, include_reasoning=False, max_tokens=2)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "include_reasoning"


class ThinkTagTokenizer(ByteTokenizer):
    """ByteTokenizer with <think> and </think> as one token each (258, 259), as Qwen3's are."""

    TAGS = {"<think>": 258, "</think>": 259}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text in self.TAGS:
            return [self.TAGS[text]]
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize(("parser", "inside"), [("deepseek_r1", True), ("qwen3", False)])
@pytest.mark.parametrize(("fields", "answer"), CONSTRAINED, ids=CONSTRAINED_IDS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_reply_reasons_first_where_the_tags_are_tokens(
    client_with, engine: FakeEngine, parser, inside, fields, answer, stream
):
    # The engine's grammar waits out the think block (the request carries its tags), and the
    # reply comes back split: the reasoning apart, the answer read as the constraint's.
    engine.tokenizer = ThinkTagTokenizer()
    engine.script, engine.max_model_len = f"<think>Paris, I think.</think>{answer}", 4096
    client = client_with(reasoning_parser=parser)
    response = _chat(client, stream=stream, **fields)
    assert response.status_code == 200, response.text
    constraint = engine.requests[-1][2].structured_outputs
    assert constraint.think == ThinkBlock(258, 259, inside=inside)
    if stream:
        deltas = [event["choices"][0]["delta"] for event in sse_json(response.text)]
        reasoning = "".join(delta.get("reasoning") or "" for delta in deltas)
        content = "".join(delta.get("content") or "" for delta in deltas)
        calls = [call for delta in deltas for call in delta.get("tool_calls") or []]
    else:
        message = response.json()["choices"][0]["message"]
        reasoning, content = message["reasoning"], message["content"]
        calls = message.get("tool_calls") or []
    assert reasoning == "Paris, I think."
    if "tools" in fields:
        assert calls and calls[0]["function"]["name"] == "get_weather" and not content
    else:
        assert content == answer


def test_an_unconstrained_request_carries_no_think_tags(client_with, engine: FakeEngine):
    engine.tokenizer = ThinkTagTokenizer()
    engine.script, engine.max_model_len = "<think>a</think>b", 4096
    response = _chat(client_with(reasoning_parser="qwen3"))
    assert response.json()["choices"][0]["message"]["reasoning"] == "a"
    assert engine.requests[-1][2].structured_outputs is None
