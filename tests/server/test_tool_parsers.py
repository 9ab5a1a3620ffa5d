"""Tool-call parsers on model-like outputs: whole and streamed in every chunk split, calls and
content come back the same; malformed calls stay content (never an error); calls stream as soon
as each parser can stand by them."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.server.tool_parsers import (
    CallDelta,
    ForcedCallsParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    PythonicParser,
    Qwen3CoderParser,
)
from pagedserve.server.tool_parsers.mistral import parse_calls as parse_mistral_calls

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


def assemble(deltas: list[CallDelta]) -> list[ParsedCall]:
    """The calls that streamed pieces make up: named by their first piece, arguments joined."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    return [ParsedCall(names[index], arguments.get(index, "")) for index in sorted(names)]


def chunked(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _run(parser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    shown, deltas = "", []
    for piece in pieces:
        text, more = parser.feed(piece)
        shown, deltas = shown + text, deltas + more
    tail, more = parser.finish()
    return shown + tail, assemble(deltas + more)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser_reads_calls_and_content_in_every_chunk_split(text, content, calls):
    assert _run(HermesParser(), [text]) == (content, calls)
    for size in (1, 2, 3, 7):
        assert _run(HermesParser(), chunked(text, size)) == (content, calls), size


def test_hermes_parser_streams_text_before_a_call_and_each_call_as_its_block_closes():
    parser = HermesParser()
    assert parser.feed("Sure <tool") == ("Sure ", [])
    assert parser.feed("_call>{") == ("", [])
    assert parser.feed('"name": "add", "arguments": {"a": 1, "b": 2}}</tool_') == ("", [])
    assert parser.feed("call>\n<tool_call>") == ("", [CallDelta(0, ADD.name, ADD.arguments)])
    body = json.dumps({"name": WEATHER.name, "arguments": json.loads(WEATHER.arguments)})
    assert parser.feed(body + "</tool_call>") == (
        "",
        [CallDelta(1, WEATHER.name, WEATHER.arguments)],
    )
    assert parser.finish() == ("", [])


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
        assert _run(Llama3JsonParser(), chunked(text, size)) == (content, calls), size


REQUIRED = json.dumps(
    [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "note", "arguments": {"text": 'a "}] {[" \\', "list": [1, {}]}},
    ]
)
NOTE = ParsedCall("note", json.dumps({"text": 'a "}] {[" \\', "list": [1, {}]}))


def test_forced_calls_parser_reads_named_arguments_and_required_lists():
    named = ForcedCallsParser("get_weather")
    assert _run(named, ['{"city": ', '"Paris"}']) == ("", [WEATHER])
    for size in (1, 3, len(REQUIRED)):  # strings holding brackets, quotes and backslashes
        assert _run(ForcedCallsParser(None), chunked(REQUIRED, size)) == ("", [ADD, NOTE]), size
    cut = ForcedCallsParser(None)  # max_tokens cut the JSON before any name: it stays text
    assert _run(cut, ['[{"name": "ad']) == ('[{"name": "ad', [])


def test_forced_calls_stream_the_name_as_soon_as_it_is_written_then_the_arguments():
    named = ForcedCallsParser("get_weather")
    assert named.feed('{"city": ') == ("", [CallDelta(0, "get_weather", '{"city": ')])
    assert named.feed('"Paris"}') == ("", [CallDelta(0, None, '"Paris"}')])
    assert named.finish() == ("", [])
    required = ForcedCallsParser(None)
    assert required.feed('[{"name": "ad') == ("", [])
    assert required.feed('d", "arguments": {"a"') == (
        "",
        [CallDelta(0, "add", ""), CallDelta(0, None, '{"a"')],
    )
    assert required.feed(": 1, ") == ("", [CallDelta(0, None, ": 1, ")])
    assert required.feed('"b": 2}}, {"name": "get_weather", "arg') == (
        "",
        [CallDelta(0, None, '"b": 2}'), CallDelta(1, "get_weather", "")],
    )
    assert required.feed('uments": {"city": "Paris"}}]') == (
        "",
        [CallDelta(1, None, '{"city": "Paris"}')],
    )
    assert required.finish() == ("", [])


def test_forced_calls_read_arguments_written_before_the_name_once_it_comes():
    text = '[{"arguments": {"a": 1, "b": 2}, "name": "add"}]'
    parser = ForcedCallsParser(None)
    assert parser.feed(text[:30]) == ("", [])
    assert parser.feed(text[30:]) == ("", [CallDelta(0, "add", '{"a": 1, "b": 2}')])


def test_a_forced_reply_cut_short_keeps_the_calls_it_began():
    # max_tokens cut the list inside the second call's arguments (finish_reason "length").
    cut = REQUIRED[: REQUIRED.index("list")]
    content, calls = _run(ForcedCallsParser(None), [cut])
    assert content == "" and calls[0] == ADD
    assert calls[1].name == "note" and NOTE.arguments.startswith(calls[1].arguments)


def test_forced_calls_parser_keeps_a_call_whose_argument_holds_the_closing_tag():
    # The grammar forced a list of calls: an argument may hold any string, "</tool_call>" too.
    text = json.dumps([{"name": "note", "arguments": {"text": "</tool_call> and <tool_call>"}}])
    expected = ParsedCall("note", json.dumps({"text": "</tool_call> and <tool_call>"}))
    assert _run(ForcedCallsParser(None), [text]) == ("", [expected])


def test_forced_calls_parser_leaves_a_list_that_names_no_call_as_text():
    text = json.dumps([{"no": "name", "arguments": {"a": 1}}, {"name": 3}])
    assert _run(ForcedCallsParser(None), [text]) == (text, [])


@pytest.mark.parametrize(
    "parser",
    [
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        PythonicParser,
        lambda: ForcedCallsParser(None),
    ],
)
def test_parsers_leave_json_nested_past_the_interpreters_limit_as_text(parser):
    deep = "[" * 5000 + "]" * 5000
    text = {
        HermesParser: f"<tool_call>{deep}</tool_call>",
        Llama3JsonParser: deep,
        MistralParser: f"[TOOL_CALLS]{deep}",
    }.get(parser, deep)
    assert _run(parser(), [text]) == (text, [])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('[add(a=1, b=2), get_weather(city="Paris")]', "", [ADD, WEATHER]),
        ("<|python_start|>[add(a=1, b=2)]<|python_end|>", "", [ADD]),
        (
            "[note(text='\u00e9t\u00e9', tags=['a', \"b\"], meta={'n': -3, 'ok': true}, x=None)]",
            "",
            [
                ParsedCall(
                    "note",
                    json.dumps(
                        {
                            "text": "\u00e9t\u00e9",
                            "tags": ["a", "b"],
                            "meta": {"n": -3, "ok": True},
                            "x": None,
                        },
                        ensure_ascii=False,
                    ),
                )
            ],
        ),
        ("[tools.search(q='x')]", "", [ParsedCall("tools.search", '{"q": "x"}')]),
        ("Hello there", "Hello there", []),
        ("[1] is a reference", "[1] is a reference", []),  # a list, but not of calls
        ("[add(1, 2)]", "[add(1, 2)]", []),  # positional arguments: not a call we can name
        ("[f(x=__import__('os'))]", "[f(x=__import__('os'))]", []),  # never evaluated
        ("[f(x=float('inf'))]", "[f(x=float('inf'))]", []),
        ("[add(a=1, b=", "[add(a=1, b=", []),  # cut short
    ],
)
def test_pythonic_parser_reads_a_list_of_calls_or_returns_text(text, content, calls):
    for size in (1, 4, len(text)):
        assert _run(PythonicParser(), chunked(text, size)) == (content, calls), size


def test_pythonic_parser_streams_plain_text_as_it_comes():
    parser = PythonicParser()
    assert parser.feed("  ") == ("", [])  # too early to tell
    assert parser.feed("Hi") == ("  Hi", [])
    assert parser.feed(" there") == (" there", [])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'),
        (HermesParser, '<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>'),
        (Llama3JsonParser, '{"name": "f", "parameters": {"a": "\\ud800"}}'),
        (PythonicParser, '[f(a="\\ud800")]'),
        (MistralParser, '[TOOL_CALLS]f[ARGS]{"a": "\\ud800"}'),
        (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": "\\ud800"}}]'),
        (lambda: ForcedCallsParser(None), '[{"name": "\\ud800", "arguments": {}}]'),
    ],
)
def test_a_lone_surrogate_escape_is_text_not_a_call(parser, text):
    # JSON and Python can spell U+D800 with an escape; UTF-8 (and so the response) cannot carry it.
    content, calls = _run(parser(), [text])
    assert calls == [] and content == text
    content.encode()  # the text as written is valid UTF-8


def test_pythonic_parser_refuses_a_repeated_keyword_and_ignores_escape_warnings():
    assert _run(PythonicParser(), ["[f(a=1, a=2)]"]) == ("[f(a=1, a=2)]", [])
    assert _run(PythonicParser(), ['[f(path="C:\\dir")]'])[1] == [
        ParsedCall("f", json.dumps({"path": "C:\\dir"}))
    ]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # Up to v7 tokenizers: one JSON list after the tag.
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [ADD]),
        (
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
            '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "",
            [ADD, WEATHER],
        ),
        # v11 and later: name[ARGS]{...} per call.
        ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "", [ADD]),
        (
            '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
            "",
            [ADD, WEATHER],
        ),
        ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Checking.", [WEATHER]),
        # v13 on: a call id before the arguments (the server gives its own).
        ('[TOOL_CALLS]add[CALL_ID]abc123XYZ[ARGS]{"a": 1, "b": 2}', "", [ADD]),
        # The tag inside an argument's string is text of that string, in either convention.
        (
            '[TOOL_CALLS][{"name": "note", "arguments": {"s": "x[TOOL_CALLS]y"}}]',
            "",
            [ParsedCall("note", '{"s": "x[TOOL_CALLS]y"}')],
        ),
        (
            '[TOOL_CALLS]note[ARGS]{"s": "x[TOOL_CALLS]y"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
            "",
            [ParsedCall("note", '{"s": "x[TOOL_CALLS]y"}'), ADD],
        ),
        ("[TOOL_CALLS]a[b[ARGS]{}", "[TOOL_CALLS]a[b[ARGS]{}", []),
        ("A [TOOL word] and [TOOL_CALL", "A [TOOL word] and [TOOL_CALL", []),
        # Not all calls: the whole reply from the tag on stays text.
        ('[TOOL_CALLS]add[ARGS]{"a": 1', '[TOOL_CALLS]add[ARGS]{"a": 1', []),
        ("[TOOL_CALLS]add{}", "[TOOL_CALLS]add{}", []),
        ("[TOOL_CALLS]my tool[ARGS]{}", "[TOOL_CALLS]my tool[ARGS]{}", []),
        ('[TOOL_CALLS]add[ARGS]{"a": 1} extra', '[TOOL_CALLS]add[ARGS]{"a": 1} extra', []),
        ('[TOOL_CALLS][{"name": "add"}, 3]', '[TOOL_CALLS][{"name": "add"}, 3]', []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ],
)
def test_mistral_parser_reads_both_conventions_in_every_chunk_split(text, content, calls):
    for size in (1, 2, 5, len(text)):
        assert _run(MistralParser(), chunked(text, size)) == (content, calls), size


def test_mistral_calls_are_read_only_after_the_tag():
    assert parse_mistral_calls('Hello [{"name": "f", "arguments": {}}]') == []


def test_mistral_parser_streams_the_text_before_the_tag():
    parser = MistralParser()
    assert parser.feed("Let me [TOOL") == ("Let me ", [])
    assert parser.feed("_CALLS]add[ARGS]") == ("", [])
    assert parser.feed('{"a": 1, "b": 2}') == ("", [])
    assert parser.finish() == ("", [CallDelta(0, ADD.name, ADD.arguments)])


# ---- Qwen3-Coder's XML calls -------------------------------------------------------------------

QWEN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "code": {"type": "string"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "b": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "zip": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "code": {"enum": ["1", "2"]},
                    "t": {"type": ["string", "null"]},
                    "spec": {"properties": {"x": {"type": "integer"}}},
                },
            },
        },
    },
]


def _qwen(name: str, **parameters: str) -> str:
    body = "".join(
        f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items()
    )
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN_CASES = [
    (_qwen("get_weather", city="Paris"), "", [WEATHER]),
    (
        "Let me check.\n" + _qwen("get_weather", city="Paris") + "\n" + _qwen("add", a="1", b="2"),
        "Let me check.\n",
        [WEATHER, ADD],
    ),
    # <tool_call> may be left out, as vLLM's parser allows
    (
        "<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>",
        "",
        [ADD],
    ),
    ("no calls: <func and <tool, < alone", "no calls: <func and <tool, < alone", []),
    (
        "<tool_call>\n<function=add>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\nstray text\n</function>\n</tool_call>",
        [],
    ),
    # A tag mentioned in the text does not swallow the call after it.
    (
        "I will use <function=get_weather> here.\n" + _qwen("get_weather", city="Paris"),
        "I will use <function=get_weather> here.",
        [WEATHER],
    ),
    # A reply that ends inside its last call: the closing tags are implied, as in vLLM.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", "", [WEATHER]),
]


@pytest.mark.parametrize(("text", "content", "calls"), QWEN_CASES)
def test_qwen3_coder_parser_reads_calls_and_content_in_every_chunk_split(text, content, calls):
    assert _run(Qwen3CoderParser(QWEN_TOOLS), [text]) == (content, calls)
    for size in (1, 2, 3, 7):
        assert _run(Qwen3CoderParser(QWEN_TOOLS), chunked(text, size)) == (content, calls), size


def test_qwen3_coder_values_are_read_as_their_schema_types_say():
    text = _qwen(
        "get_weather",
        city="3",  # a string stays a string, though it looks like a number
        days="12345678901234567890",  # exactly, however long
        metric="True",
        ratio="2.0",
        tags='["a", "b"]',
        code="null",
    )
    (call,) = _run(Qwen3CoderParser(QWEN_TOOLS), [text])[1]
    assert json.loads(call.arguments) == {
        "city": "3",
        "days": 12345678901234567890,
        "metric": True,
        "ratio": 2,
        "tags": ["a", "b"],
        "code": None,
    }
    # Types from anyOf, enum, type lists; untyped or undeclared parameters are text, as vLLM's.
    untyped = _qwen(
        "add", a="7", b="8", zip="12345", code="1", t="true", spec="{'x': 1}", extra="[1]"
    )
    (call,) = _run(Qwen3CoderParser(QWEN_TOOLS), [untyped])[1]
    assert json.loads(call.arguments) == {
        "a": 7,
        "b": 8,
        "zip": "12345",
        "code": "1",
        "t": "true",
        "spec": "{'x': 1}",
        "extra": "[1]",
    }
    odd = _qwen("get_weather", days="3.5", ratio="nan", metric="maybe")
    (call,) = _run(Qwen3CoderParser(QWEN_TOOLS), [odd])[1]
    assert json.loads(call.arguments) == {"days": "3.5", "ratio": "nan", "metric": "maybe"}


def test_qwen3_coder_parser_streams_text_then_each_call_as_it_closes():
    parser = Qwen3CoderParser(QWEN_TOOLS)
    assert parser.feed("Sure <func") == ("Sure ", [])
    assert parser.feed("tion=add>\n<parameter=a>\n1\n</parameter>\n") == ("", [])
    assert parser.feed("<parameter=b>\n2\n</parameter>\n</function>") == ("", [])
    assert parser.feed("\n<function=get_weather>") == ("", [CallDelta(0, ADD.name, ADD.arguments)])
    assert parser.feed("<parameter=city>Paris</parameter></function>") == ("", [])
    assert parser.finish() == ("", [CallDelta(1, WEATHER.name, WEATHER.arguments)])


def test_qwen3_coder_streamed_and_whole_agree_on_tag_soup():
    # Texts built from the format's own pieces: every chunk split reads what the whole text reads.
    pieces = ["<tool_call>", "</tool_call>", "<function=add>", "<function=", "</function>", "\n"]
    pieces += ["<parameter=a>", "</parameter>", "<parameter=", "1", "x", "<", ">", " "]
    generator = random.Random(7)
    for _ in range(300):
        text = "".join(generator.choice(pieces) for _ in range(generator.randint(1, 14)))
        whole = _run(Qwen3CoderParser(QWEN_TOOLS), [text])
        for size in (1, 2, 3):
            assert _run(Qwen3CoderParser(QWEN_TOOLS), chunked(text, size)) == whole, text


def test_qwen3_coder_unclosed_tags_are_read_in_one_pass():
    # Before, each unclosed tag rescanned the rest: 12,000 of them took 13 s on the event loop.
    text = "<function=add>" + "<parameter=a>x" * 20_000  # a call cut short: its tags implied
    assert _run(Qwen3CoderParser(QWEN_TOOLS), [text]) == ("", [ParsedCall("add", '{"a": "x"}')])
    text = "<function=a>x" * 20_000
    assert _run(Qwen3CoderParser(QWEN_TOOLS), [text])[0] == text
