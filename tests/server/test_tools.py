"""Tool calling at the HTTP layer (fake engine): checks before queueing, the fallback prompt block,
the constraint that forces "required" and named calls, and the auto parser's response shape."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import FakeEngine, sse_json

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.fixture(autouse=True)
def long_context(engine: FakeEngine) -> None:
    engine.max_model_len = 4096  # the fallback tools block alone is ~800 byte tokens


def _chat(client, **fields):
    return client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto, but the server has no parser
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_parameter(client, engine, fields, param):
    response = _chat(client, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


def test_required_forces_a_list_of_calls_to_the_given_tools(client, engine: FakeEngine):
    assert _chat(client, tools=[WEATHER, ADD], tool_choice="required").status_code == 200
    [(_, prompt, params)] = engine.requests
    constraint = params.structured_outputs
    assert (constraint.kind, constraint.param) == ("json", "tools")
    schema = json.loads(constraint.spec)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    text = bytes(prompt).decode()
    assert "<tools>" in text and '"get_weather"' in text  # the fake template ignores tools


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Each resolves its references against its own root: `$defs` (as pydantic writes nested models),
# `definitions`, and the root itself (a recursive tool).
LOCATED = _tool(
    "locate",
    {
        "type": "object",
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "properties": {"loc": {"$ref": "#/$defs/Loc"}},
        "required": ["loc"],
    },
)
TREE = _tool("tree", {"type": "object", "properties": {"child": {"$ref": "#"}}})
COUNTED = _tool(
    "count",
    {
        "type": "object",
        "definitions": {"N": {"type": "integer"}},
        "properties": {"n": {"$ref": "#/definitions/N"}, "$ref": {"enum": ["#"]}},
    },
)


def test_required_resolves_each_tools_references_in_that_tools_schema(client, engine: FakeEngine):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    response = _chat(client, tools=[LOCATED, TREE, COUNTED], tool_choice="required")
    assert response.status_code == 200, response.text
    [(_, _, params)] = engine.requests
    grammar = Grammar.from_json_schema(params.structured_outputs.spec)

    def accepts(name: str, arguments: object) -> bool:
        return _is_grammar_accept_string(
            grammar, json.dumps([{"name": name, "arguments": arguments}])
        )

    assert accepts("locate", {"loc": {"city": "Paris"}})
    assert not accepts("locate", {"loc": "Paris"})
    assert accepts("tree", {"child": {"child": {}}})
    assert not accepts("tree", {"child": [{"name": "tree", "arguments": {}}]})  # the array's root
    assert accepts("count", {"n": 3, "$ref": "#"})  # a property named $ref, an enum of "#"
    assert not accepts("count", {"n": "3"})


def test_named_tool_forces_its_arguments_schema_and_one_call(client, engine: FakeEngine):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    _chat(client, tools=[WEATHER, ADD], tool_choice=choice, parallel_tool_calls=False)
    [(_, _, params)] = engine.requests
    assert json.loads(params.structured_outputs.spec) == WEATHER["function"]["parameters"]


def test_tool_choice_none_renders_no_tools_and_constrains_nothing(client, engine: FakeEngine):
    assert _chat(client, tools=[WEATHER], tool_choice="none").status_code == 200
    [(_, prompt, params)] = engine.requests
    assert params.structured_outputs is None
    assert "<tools>" not in bytes(prompt).decode()


def test_assistant_calls_and_tool_results_render_in_the_fallback_tags(client, engine: FakeEngine):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]
    response = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 4},
    )
    assert response.status_code == 200, response.text
    text = bytes(engine.requests[0][1]).decode()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool>\n<tool_response>\n22C\n</tool_response>" in text.replace("<tool><", "<tool>\n<")


def test_auto_with_the_hermes_parser_returns_openai_tool_calls(client_with, engine: FakeEngine):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="hermes")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call>'
    engine.script = call  # the fake engine writes this text
    body = _chat(client, tools=[WEATHER], max_tokens=len(call) + 1).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["id"].startswith("call_") and tool_call["type"] == "function"
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "P"}'}


@pytest.mark.parametrize(("parallel", "num_calls"), [(True, 2), (False, 1)])
def test_auto_keeps_one_call_when_parallel_tool_calls_is_false(
    client_with, engine: FakeEngine, parallel, num_calls
):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="hermes")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call>'
    engine.script = call + call.replace('"P"', '"Q"')
    for stream in (False, True):
        response = _chat(
            client,
            tools=[WEATHER],
            max_tokens=2 * len(call) + 1,
            parallel_tool_calls=parallel,
            stream=stream,
        )
        text = response.text
        assert text.count('"get_weather"') == num_calls, text
        assert (r"\"Q\"" in text) == parallel  # the second call's arguments, escaped


def test_earlier_call_arguments_nested_past_the_interpreters_limit_render_as_sent(
    client, engine: FakeEngine
):
    engine.max_model_len = 16384  # byte tokens
    deep = "[" * 5000 + "]" * 5000
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert deep in bytes(engine.requests[0][1]).decode()


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": ["object", "number"], "properties": {"x": {"type": "string"}}},
        {"properties": {"x": {"type": "string"}}},  # no type: any JSON value, unforced
    ],
)
def test_forced_arguments_are_an_object_whatever_else_the_schema_allows(
    client, engine: FakeEngine, parameters
):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    choice = {"type": "function", "function": {"name": "f"}}
    assert _chat(client, tools=[tool], tool_choice=choice).status_code == 200
    [(_, _, params)] = engine.requests
    assert json.loads(params.structured_outputs.spec) == {**parameters, "type": "object"}


@pytest.mark.parametrize("mode", ["named", "required"])
def test_forced_calls_stream_their_arguments_as_the_model_writes_them(
    client, engine: FakeEngine, mode
):
    arguments = '{"city": "Paris"}'
    if mode == "named":
        engine.script = arguments  # the fake engine writes a character a step
        choice = {"type": "function", "function": {"name": "get_weather"}}
    else:
        engine.script = f'[{{"name": "get_weather", "arguments": {arguments}}}]'
        choice = "required"
    fields = {"tools": [WEATHER], "tool_choice": choice, "max_tokens": len(engine.script) + 1}
    events = sse_json(_chat(client, stream=True, **fields).text)
    pieces = [
        piece for event in events for piece in event["choices"][0]["delta"].get("tool_calls", [])
    ]
    header, *rest = pieces
    assert header["id"].startswith("call_") and header["function"]["name"] == "get_weather"
    assert len(rest) >= len(arguments) - 1  # the arguments came in many pieces, not one
    assert "".join(piece["function"]["arguments"] for piece in rest) == arguments
    assert all(piece["index"] == 0 and "id" not in piece for piece in rest)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = _chat(client, **fields).json()["choices"][0]
    assert whole["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": arguments,
    }
    assert whole["finish_reason"] == "tool_calls"


def test_a_named_call_cut_short_by_max_tokens_keeps_its_unfinished_arguments(
    client, engine: FakeEngine
):
    engine.script = '{"city": "Paris"}'
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _chat(client, tools=[WEATHER], tool_choice=choice, max_tokens=5).json()["choices"][0]
    assert whole["finish_reason"] == "length"
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == '{"cit'


def test_auto_streams_each_call_when_its_block_closes(client_with, engine: FakeEngine):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="hermes")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call>'
    engine.script = call + call.replace('"P"', '"Q"')
    fields = {"max_tokens": 2 * len(call) + 1, "stream": True, "return_token_ids": True}
    events = sse_json(_chat(client, tools=[WEATHER], **fields).text)[1:]  # after the role's
    tokens_before, num_tokens = [], 0  # per call: the tokens streamed before it
    for event in events:
        (choice,) = event["choices"]
        if choice["delta"].get("tool_calls", [{}])[0].get("id"):
            tokens_before.append(num_tokens)
        num_tokens += len(choice.get("token_ids", []))
    # One character a step: each call went out as its block closed, not at the end.
    assert tokens_before == [len(call), 2 * len(call)]


def test_auto_with_the_pythonic_parser_returns_openai_tool_calls(client_with, engine):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    engine.script = '[get_weather(city="P")]'
    body = _chat(client, tools=[WEATHER], max_tokens=len(engine.script) + 1).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "P"}',
    }


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_the_qwen3_coder_parser_reads_values_as_the_tool_s_types(
    client_with, engine, stream
):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    tool = {
        "type": "function",
        "function": {
            "name": "forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
    engine.script = (
        "On it.\n<tool_call>\n<function=forecast>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    response = _chat(client, tools=[tool], max_tokens=len(engine.script) + 1, stream=stream)
    if stream:
        chunks = sse_json(response.text)
        arguments = "".join(
            call["function"].get("arguments", "")
            for chunk in chunks
            for choice in chunk["choices"]
            for call in choice["delta"].get("tool_calls") or []
        )
        content = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    else:
        [choice] = response.json()["choices"]
        arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
        content, finish = choice["message"]["content"], choice["finish_reason"]
    assert json.loads(arguments) == {"city": "42", "days": 3}  # the string stays a string
    assert content.strip() == "On it." and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_spelling_a_lone_surrogate_comes_back_as_text_not_a_500(client_with, engine, stream):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="hermes")
    engine.script = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'
    response = _chat(client, tools=[WEATHER], max_tokens=len(engine.script) + 1, stream=stream)
    assert response.status_code == 200 and "error" not in response.text, response.text
    assert "tool_calls" not in response.text and "\\\\ud800" in response.text


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_the_mistral_parser_keeps_its_tag_and_gives_nine_character_ids(
    client_with, engine: FakeEngine, stream
):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="mistral")
    engine.script = '[TOOL_CALLS]get_weather[ARGS]{"city": "P"}'
    response = _chat(client, tools=[WEATHER], max_tokens=len(engine.script) + 1, stream=stream)
    # [TOOL_CALLS] is a special token in Mistral's vocabulary: the text must keep it.
    assert engine.requests[-1][2].skip_special_tokens is False
    if stream:
        deltas = [event["choices"][0]["delta"] for event in sse_json(response.text)]
        pieces = [call for delta in deltas for call in delta.get("tool_calls") or []]
        tool_call = pieces[0]  # the first piece has the id and name, then the arguments come
        arguments = "".join(piece["function"].get("arguments") or "" for piece in pieces)
        tool_call["function"]["arguments"] = arguments
        assert {piece["index"] for piece in pieces} == {0}
        assert not "".join(delta.get("content") or "" for delta in deltas)
    else:
        [choice] = response.json()["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "P"}'}
    # Mistral's chat templates refuse other ids when the conversation comes back.
    assert len(tool_call["id"]) == 9 and tool_call["id"].isalnum()


def test_forced_calls_under_the_mistral_parser_get_nine_character_ids_too(client_with, engine):
    client = client_with(enable_auto_tool_choice=True, tool_call_parser="mistral")
    engine.script = '{"city": "P"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = _chat(client, tools=[WEATHER], tool_choice=named, max_tokens=20).json()
    [tool_call] = body["choices"][0]["message"]["tool_calls"]
    assert len(tool_call["id"]) == 9 and tool_call["id"].isalnum()
    assert engine.requests[-1][2].skip_special_tokens is True  # forced: no tag to read
