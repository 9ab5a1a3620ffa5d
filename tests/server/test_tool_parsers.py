"""Tool-call parsers on model-like outputs: whole and streamed in every chunk split, calls and
content come back the same; malformed calls stay content (never an error)."""

from __future__ import annotations

import json

import pytest

from pagedserve.server.tool_parsers import HermesParser, Llama3JsonParser, ParsedCall
from pagedserve.server.tools import ForcedCallsParser

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
ADD = ParsedCall("add", '{"a": 1, "b": 2}')


def _hermes(call: ParsedCall) -> str:
    body = {"name": call.name, "arguments": json.loads(call.arguments)}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


HERMES_CASES = [
    (_hermes(WEATHER), "", [WEATHER]),
    (_hermes(WEATHER) + "\n" + _hermes(ADD), "", [WEATHER, ADD]),
    ("Let me check.\n" + _hermes(WEATHER), "Let me check.\n", [WEATHER]),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("no calls at all, < and <tool but no tag", "no calls at all, < and <tool but no tag", []),
    ("<tool_call>" + json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}}), "", [ADD]),
]


def _run(parser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    shown = "".join(parser.feed(piece) for piece in pieces)
    tail, calls = parser.finish()
    return shown + tail, calls


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser_reads_calls_and_content_in_every_chunk_split(text, content, calls):
    assert _run(HermesParser(), [text]) == (content, calls)
    for size in (1, 2, 3, 7):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert _run(HermesParser(), pieces) == (content, calls), size


def test_hermes_parser_streams_text_before_a_call_and_holds_a_partial_tag():
    parser = HermesParser()
    assert parser.feed("Sure <tool") == "Sure "
    assert parser.feed("_call>{") == ""
    assert parser.feed('"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == ""
    assert parser.finish() == ("", [ADD])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ADD]),
        (
            '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "",
            [ADD, WEATHER],
        ),
        ("Hello there", "Hello there", []),
        ('{"name": "add", "parameters": ', '{"name": "add", "parameters": ', []),
    ],
)
def test_llama3_json_parser_reads_calls_or_returns_text(text, content, calls):
    for size in (1, 4, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert _run(Llama3JsonParser(), pieces) == (content, calls)


def test_forced_calls_parser_reads_named_arguments_and_required_lists():
    named = ForcedCallsParser("get_weather")
    assert _run(named, ['{"city": ', '"Paris"}']) == ("", [WEATHER])
    required = ForcedCallsParser(None)
    text = json.dumps([{"name": "add", "arguments": {"a": 1, "b": 2}}])
    assert _run(required, [text]) == ("", [ADD])
    cut = ForcedCallsParser(None)  # max_tokens cut the JSON: it stays text
    assert _run(cut, ['[{"name": "ad']) == ('[{"name": "ad', [])


def test_forced_calls_parser_keeps_a_call_whose_argument_holds_the_closing_tag():
    # The grammar forced a list of calls: an argument may hold any string, "</tool_call>" too.
    text = json.dumps([{"name": "note", "arguments": {"text": "</tool_call> and <tool_call>"}}])
    expected = ParsedCall("note", json.dumps({"text": "</tool_call> and <tool_call>"}))
    assert _run(ForcedCallsParser(None), [text]) == ("", [expected])


def test_forced_calls_parser_leaves_a_list_that_is_not_calls_as_text():
    text = json.dumps([{"name": "add", "arguments": {"a": 1}}, {"no": "name"}])
    assert _run(ForcedCallsParser(None), [text]) == (text, [])


@pytest.mark.parametrize(
    "parser", [HermesParser, Llama3JsonParser, lambda: ForcedCallsParser(None)]
)
def test_parsers_leave_json_nested_past_the_interpreters_limit_as_text(parser):
    deep = "[" * 5000 + "]" * 5000
    text = {
        HermesParser: f"<tool_call>{deep}</tool_call>",
        Llama3JsonParser: deep,
    }.get(parser, deep)
    assert _run(parser(), [text]) == (text, [])
