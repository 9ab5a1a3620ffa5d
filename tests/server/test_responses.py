"""POST /v1/responses with the fake engine: the request reaches the engine as the equivalent chat
request (instructions, items, tools, text formats, reasoning effort), the chat route's output
comes back as OpenAI's output items (a message, reasoning, function calls) with usage, streamed as
OpenAI's typed events whose deltas rebuild the final response, and what the server cannot serve
is a 400 naming the field. Stored responses continue as conversations (previous_response_id),
within the store's bound."""

from __future__ import annotations

import json
import time
from typing import Any
from unittest.mock import ANY

import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from pagedserve.engine.errors import RequestFailedError
from tests.server.conftest import FakeEngine

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
STREAM_EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call>'


def _events(text: str) -> list[dict[str, Any]]:
    """The streamed events; each `event:` line names its JSON's type."""
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def _respond(client, **body: Any):
    return client.post("/v1/responses", json={"input": "hi"} | body)


def _prompt(engine: FakeEngine) -> str:
    return bytes(engine.requests[-1][1]).decode()


def test_a_string_input_gets_a_message_and_usage(client, engine: FakeEngine):
    response = _respond(client, max_output_tokens=20)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "completed" and body["store"] is True
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed" and message["id"].startswith("msg_")
    assert message["content"] == [
        {"type": "output_text", "text": "abcdefgh", "annotations": [], "logprobs": []}
    ]
    usage = body["usage"]
    assert usage["output_tokens"] == 9  # eight letters and EOS
    assert usage["total_tokens"] == usage["input_tokens"] + 9
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert _prompt(engine) == "<user>hi\n<assistant>"
    assert engine.requests[-1][2].max_tokens == 20


def test_hitting_max_output_tokens_makes_the_response_incomplete(client):
    body = _respond(client, max_output_tokens=3).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "abc"


@pytest.fixture
def tool_client(client_with, engine: FakeEngine):
    engine.max_model_len = 2048
    return client_with(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_instructions_and_items_become_the_chat_conversation(tool_client, engine: FakeEngine):
    client = tool_client
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier reasoning: dropped
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "22C"},
    ]
    response = _respond(client, instructions="You help.", input=items, tools=[WEATHER])
    assert response.status_code == 200, response.text
    prompt = _prompt(engine)
    assert prompt.startswith("<system>You help.\n\nYou are a function calling AI model.")
    assert prompt.endswith(
        "<system>be brief\n<user>hi\n<assistant>hello\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {}}\n</tool_call>\n'
        "<tool><tool_response>\n22C\n</tool_response>\n<assistant>"
    )


def test_sampling_fields_text_formats_and_reasoning_effort_reach_the_engine(
    client, engine: FakeEngine
):
    engine.max_model_len = 2048
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    response = _respond(
        client, temperature=0.5, top_p=0.9, top_k=3, seed=7, text=text, reasoning={"effort": "low"}
    )
    assert response.status_code == 200, response.text
    params = engine.requests[-1][2]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 3, 7)
    assert params.structured_outputs.kind == "json"
    assert json.loads(params.structured_outputs.spec) == schema
    assert _prompt(engine).startswith("[enable_thinking=True][reasoning_effort=low]")
    body = response.json()
    assert body["text"]["format"]["schema"] == schema and body["temperature"] == 0.5
    assert body["reasoning"] == {"effort": "low"}
    _respond(client, text={"format": {"type": "json_object"}})
    assert engine.requests[-1][2].structured_outputs.kind == "json_object"


def test_logprobs_come_with_the_text_when_included(client):
    include = ["message.output_text.logprobs"]
    body = _respond(client, include=include, top_logprobs=1, max_output_tokens=2).json()
    [part] = body["output"][0]["content"]
    assert [entry["token"] for entry in part["logprobs"]] == ["a", "b"]
    assert all(len(entry["top_logprobs"]) == 1 for entry in part["logprobs"])
    assert _respond(client, top_logprobs=0).status_code == 200  # vLLM's default, no include


@pytest.mark.parametrize("stop", [None, ["ef"]])
def test_the_messages_logprobs_are_every_token_chat_scores(client, stop):
    """Tokens whose text is held back (here by a stop string) keep their logprobs."""
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stop": stop},
    ).json()
    body = _respond(client, include=["message.output_text.logprobs"], stop=stop).json()
    [part] = body["output"][0]["content"]
    assert part["logprobs"] == chat["choices"][0]["logprobs"]["content"]
    assert part["text"] == chat["choices"][0]["message"]["content"]


def test_a_function_call_becomes_an_output_item(tool_client, engine: FakeEngine):
    client = tool_client
    engine.script = CALL
    body = _respond(client, tools=[WEATHER], max_output_tokens=len(CALL) + 1).json()
    [call] = body["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "P"}')
    assert body["tools"] == [WEATHER] and body["status"] == "completed"
    forced = _respond(client, tools=[WEATHER], tool_choice={"type": "function", "name": "x"})
    assert forced.status_code == 400 and "x" in forced.json()["error"]["message"]


def test_reasoning_comes_as_its_own_item_and_counts_its_tokens(client_with, engine: FakeEngine):
    client = client_with(reasoning_parser="qwen3")
    engine.script = "<think>hmm</think>yes"
    body = _respond(client, max_output_tokens=40).json()
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "yes"
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == len("<think>hmm")
    hidden = _respond(client, include_reasoning=False).json()  # vLLM's
    assert [item["type"] for item in hidden["output"]] == ["message"]


def test_an_item_cut_short_by_max_output_tokens_is_incomplete(client_with, engine: FakeEngine):
    client = client_with(reasoning_parser="qwen3")
    engine.script = "<think>a long thought</think>yes"
    body = _respond(client, max_output_tokens=12).json()
    [reasoning] = body["output"]
    assert reasoning["status"] == "incomplete" and body["status"] == "incomplete"


@pytest.mark.parametrize(
    ("settings", "script", "body"),
    [
        ({}, "", {}),
        ({"reasoning_parser": "qwen3"}, "<think>hmm</think>yes", {}),
        (
            {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"},
            "ok" + CALL + CALL.replace('"P"', '"Q"'),
            {"tools": [WEATHER]},
        ),
    ],
    ids=["text", "reasoning", "calls"],
)
def test_streamed_events_rebuild_the_final_response(
    client_with, engine: FakeEngine, settings, script, body
):
    client = client_with(**settings)
    engine.script, engine.max_model_len = script, 2048
    whole = _respond(client, **body)
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    events = _events(_respond(client, stream=True, **body).text)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    # Every event and the response parse as the official SDK's types, strictly.
    for event in events:
        STREAM_EVENT.validate_python(event, strict=True)
    Response.model_validate(whole, strict=True)
    final = events[-1]["response"]
    assert final["usage"] == whole["usage"]
    rebuilt: dict[str, str] = {}  # item id -> its text or arguments, from the deltas
    for event in events:
        if event["type"].endswith(".delta"):
            rebuilt[event["item_id"]] = rebuilt.get(event["item_id"], "") + event["delta"]
    outputs = [_strip_ids(item) for item in final["output"]]
    assert outputs == [_strip_ids(item) for item in whole["output"]]
    for index, item in enumerate(final["output"]):
        text = item.get("arguments", None)
        if text is None:
            text = item["content"][0]["text"]
        assert rebuilt[item["id"]] == text
        added = next(e for e in events if e["type"] == "response.output_item.added" and
                     e["output_index"] == index)  # fmt: skip
        done = next(e for e in events if e["type"] == "response.output_item.done" and
                    e["output_index"] == index)  # fmt: skip
        assert added["item"]["id"] == item["id"] and done["item"] == item
        assert kinds.index("response.output_item.added") < kinds.index("response.output_item.done")


def _strip_ids(item: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in item.items() if key not in ("id", "call_id")}


def test_a_failure_after_the_stream_began_ends_it_with_response_failed(client, engine):
    engine.fail_after_first_delta = RequestFailedError("the engine failed this request")
    events = _events(_respond(client, stream=True).text)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {
        "code": "server_error",  # OpenAI's codes only
        "message": "the engine failed this request",
    }
    STREAM_EVENT.validate_python(events[-1], strict=True)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "reads no 'input_image'",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
        ({"input": []}, "input", "no message"),
        ({"background": True, "store": False}, "background", "needs store"),
        ({"background": True, "stream": True}, "stream", "poll"),
        ({"include": ["nonsense"]}, "include", "unknown value"),
        ({"top_logprobs": 2}, "top_logprobs", "include"),
        ({"max_output_tokens": 10_000}, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"tools": [WEATHER | {"name": "no spaces"}]}, "tools", "tools.0.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice", "tool_choice"),
        ({"text": {"verbosity": "high"}}, "text", "verbosity"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
        ({"temperature": -1}, "temperature", "temperature"),
        ({"input": 5}, "input", "input"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(client, body, param, says):
    response = _respond(client, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and (error["param"] or "").startswith(param), error


def test_an_unknown_model_is_a_404(client):
    assert _respond(client, model="nope").status_code == 404


def test_previous_response_id_continues_a_stored_conversation(tool_client, engine: FakeEngine):
    client = tool_client
    engine.script = CALL
    first = _respond(client, instructions="Be brief.", tools=[WEATHER]).json()
    [call] = first["output"]
    follow_up = [{"type": "function_call_output", "call_id": call["call_id"], "output": "22C"}]
    engine.script = "sunny"
    second = _respond(client, input=follow_up, previous_response_id=first["id"], tools=[WEATHER])
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == first["id"]
    prompt = _prompt(engine)
    assert "Be brief." not in prompt  # instructions are not carried over (OpenAI's rule)
    assert prompt.endswith(
        "<user>hi\n<assistant><tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>\n'
        "<tool><tool_response>\n22C\n</tool_response>\n<assistant>"
    )
    third = _respond(client, input="and?", previous_response_id=second.json()["id"])
    assert _prompt(engine).endswith("<assistant>sunny\n<user>and?\n<assistant>")
    assert third.json()["output"][0]["content"][0]["text"] == "sunny"


def test_stored_responses_are_retrieved_and_deleted(client):
    body = _respond(client).json()
    streamed = _events(_respond(client, stream=True).text)[-1]["response"]
    for stored in (body, streamed):
        response = client.get(f"/v1/responses/{stored['id']}")
        assert response.status_code == 200 and response.json() == stored
    deleted = client.delete(f"/v1/responses/{body['id']}")
    assert deleted.json() == {"id": body["id"], "object": "response", "deleted": True}
    for response in (
        client.get(f"/v1/responses/{body['id']}"),
        client.delete(f"/v1/responses/{body['id']}"),
        _respond(client, previous_response_id=body["id"]),
    ):
        assert response.status_code == 404 and body["id"] in response.json()["error"]["message"]


INPUT_ITEMS: TypeAdapter = TypeAdapter(list[ResponseItem])


def _without_id(item: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in item.items() if key != "id"}


def _input_items(client, response_id: str, **params: Any):
    return client.get(f"/v1/responses/{response_id}/input_items", params=params)


def test_a_stored_response_lists_its_input_as_openai_items(tool_client):
    client = tool_client
    assert _input_items(client, _respond(client).json()["id"]).json() | {"data": []} == {
        "object": "list",
        "data": [],
        "first_id": ANY,
        "last_id": ANY,
        "has_more": False,
    }
    items = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "id": "fc_1",
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "P"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "22C"},
    ]
    body = _respond(client, input=items, tools=[WEATHER]).json()
    listed = _input_items(client, body["id"], order="asc").json()
    INPUT_ITEMS.validate_python(listed["data"])  # the openai SDK's item types parse them
    assert [_without_id(item) for item in listed["data"]] == [
        {
            "type": "message",
            "role": "system",
            "status": "completed",
            "content": [{"type": "input_text", "text": "Be brief."}],
        },
        {
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": "hi"}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "P"}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "c1", "output": "22C", "status": "completed"},
    ]
    ids = [item["id"] for item in listed["data"]]
    assert ids[2] == "fc_1" and ids[0].startswith("msg_") and ids[3].startswith("fco_")
    assert len(set(ids)) == 4 and listed["first_id"] == ids[0] and listed["last_id"] == ids[3]
    newest_first = _input_items(client, body["id"]).json()  # OpenAI's default order: desc
    assert [item["id"] for item in newest_first["data"]] == ids[::-1]  # the same ids each time


def test_every_side_of_a_conversation_is_listed_in_the_sdks_item_shapes(tool_client):
    client = tool_client
    items = [
        {"role": "assistant", "content": "earlier answer", "phase": "final_answer"},
        {"role": "user", "content": [{"type": "output_text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "input_text", "text": "c"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "output_text", "text": "o"}]},
        {"role": "user", "content": "go on"},
    ]  # fmt: skip
    response = _respond(client, input=items, tools=[WEATHER])
    assert response.status_code == 200, response.text
    listed = _input_items(client, response.json()["id"], order="asc").json()["data"]
    parsed = INPUT_ITEMS.validate_python(listed, strict=True)
    assert [type(item).__name__ for item in parsed] == [
        "ResponseOutputMessage", "ResponseInputMessageItem", "ResponseOutputMessage",
        "ResponseReasoningItem", "ResponseFunctionToolCallItem",
        "ResponseFunctionToolCallOutputItem", "ResponseInputMessageItem",
    ]  # fmt: skip
    assert listed[0]["content"] == [
        {"type": "output_text", "text": "earlier answer", "annotations": [], "logprobs": []}
    ]
    assert listed[0]["phase"] == "final_answer"  # the client's own fields stay
    assert [part["text"] for part in listed[1]["content"]] == ["a", "b"]
    reasoning = listed[3]
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert listed[5]["output"] == [{"type": "input_text", "text": "o"}]


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ({"id": "msg_\ud800", "role": "user", "content": "hi"}, "not valid Unicode"),
        ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "\ud800"}]}, "Unicode"),
    ],
)
def test_an_input_item_that_cannot_be_stored_is_a_400_before_the_engine_runs(
    client, engine: FakeEngine, item, says
):
    # json.dumps writes the lone surrogate as the escape \\ud800, which the server decodes
    body = json.dumps({"input": [{"role": "user", "content": "hi"}, item]})
    response = client.post(
        "/v1/responses", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and says in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "input"
    assert engine.requests == [] and engine.in_flight == 0


def test_two_input_items_with_one_id_are_a_400_as_openai_says(client, engine: FakeEngine):
    items = [{"id": "msg_1", "role": "user", "content": str(i)} for i in range(2)]
    response = _respond(client, input=items)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    assert "Duplicate item found with id msg_1" in response.json()["error"]["message"]
    assert engine.requests == []


def test_input_items_come_a_page_at_a_time(client):
    body = _respond(client, input=[{"role": "user", "content": str(i)} for i in range(5)]).json()
    ids = [item["id"] for item in _input_items(client, body["id"], order="asc").json()["data"]]
    first = _input_items(client, body["id"], order="asc", limit=2).json()
    assert [item["id"] for item in first["data"]] == ids[:2] and first["has_more"]
    rest = _input_items(client, body["id"], order="asc", after=first["last_id"]).json()
    assert [item["id"] for item in rest["data"]] == ids[2:] and not rest["has_more"]
    between = _input_items(client, body["id"], after=ids[4], before=ids[1]).json()  # desc
    assert [item["id"] for item in between["data"]] == [ids[3], ids[2]]
    assert not between["has_more"]
    one = _input_items(client, body["id"], after=ids[4], before=ids[1], limit=1).json()
    assert [item["id"] for item in one["data"]] == [ids[3]] and one["has_more"]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "msg_nope"}, "after"),
        ({"before": "msg_nope"}, "before"),
        ({"include": "file_search_call.result"}, "include"),
        ({"include[]": "file_search_call.result"}, "include"),  # as the openai SDK sends it
    ],
)
def test_bad_input_item_queries_are_a_400_naming_the_parameter(client, params, param):
    response = _input_items(client, _respond(client).json()["id"], **params)
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"]["param"] or "")


def test_input_items_of_an_unknown_or_deleted_response_are_a_404(client):
    body = _respond(client).json()
    client.delete(f"/v1/responses/{body['id']}")
    for response_id in (body["id"], "resp_nope"):
        response = _input_items(client, response_id)
        assert response.status_code == 404 and response_id in response.json()["error"]["message"]


def test_store_false_keeps_nothing(client):
    body = _respond(client, store=False).json()
    assert body["store"] is False
    assert client.get(f"/v1/responses/{body['id']}").status_code == 404


def test_the_store_forgets_the_least_recently_used_past_its_memory(client_with, engine):
    engine.max_model_len = 2048
    size = len(_respond(client_with()).content)  # a fake answer's JSON, about the same each time
    client = client_with(responses_store_memory=f"{int(2.5 * (size + 40))}B")  # two, with turns
    first, _, third = (_respond(client).json()["id"] for _ in range(3))
    assert client.get(f"/v1/responses/{first}").status_code == 404
    fourth = _respond(client, previous_response_id=third).json()["id"]
    fifth = _respond(client, previous_response_id=fourth).json()["id"]  # reads fourth, third:
    broken = _respond(client, previous_response_id=fifth)  # fourth was the oldest then
    assert broken.status_code == 404
    assert broken.json()["error"]["message"] == (
        f"A response it continues with id '{fourth}' not found."
    )


def test_a_response_larger_than_the_whole_store_is_answered_unstored(client_with):
    client = client_with(responses_store_memory="100B")
    body = _respond(client).json()
    assert body["store"] is False
    assert client.get(f"/v1/responses/{body['id']}").status_code == 404
    final = _events(_respond(client, stream=True).text)[-1]["response"]
    assert final["store"] is False


def test_without_a_store_store_is_false_and_nothing_can_be_continued(client_with):
    client = client_with(responses_store_memory="0")
    assert _respond(client).json()["store"] is False
    response = _respond(client, previous_response_id="resp_1")
    assert response.status_code == 400 and "stores no responses" in response.text


def _poll(client, response_id: str, until: set[str]) -> dict[str, Any]:
    for _ in range(500):
        body = client.get(f"/v1/responses/{response_id}").json()
        if body["status"] in until:
            return body
        time.sleep(0.01)
    raise AssertionError(f"still {body['status']}")


def test_a_background_response_answers_at_once_and_is_polled_to_its_end(client, engine):
    whole = _respond(client, max_output_tokens=3).json()
    queued = _respond(client, max_output_tokens=3, background=True)
    assert queued.status_code == 200
    body = queued.json()
    assert body["status"] == "queued" and body["background"] is True and body["output"] == []
    done = _poll(client, body["id"], {"completed", "incomplete"})
    Response.model_validate(done, strict=True)
    assert done["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    assert done["usage"] == whole["usage"]
    cancelled = client.post(f"/v1/responses/{body['id']}/cancel")  # ended: returned as it ended
    assert cancelled.status_code == 200 and cancelled.json()["status"] == done["status"]


def test_a_background_response_is_cancelled_and_its_engine_request_aborted(client, engine):
    engine.hang_after_first_delta = True
    body = _respond(client, background=True).json()
    running = _poll(client, body["id"], {"in_progress"})
    assert running["status"] == "in_progress"
    cancelled = client.post(f"/v1/responses/{body['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    Response.model_validate(cancelled.json(), strict=True)
    assert client.get(f"/v1/responses/{body['id']}").json()["status"] == "cancelled"
    assert len(engine.closed_early) == 1 and engine.in_flight == 0  # its engine request closed


def test_a_background_failure_is_its_stored_status(client, engine):
    engine.fail_after_first_delta = RequestFailedError("the engine broke")
    body = _respond(client, background=True).json()
    failed = _poll(client, body["id"], {"failed"})
    assert failed["error"] == {"code": "server_error", "message": "the engine broke"}


def test_only_a_stored_background_response_can_be_cancelled(client):
    plain = _respond(client).json()
    response = client.post(f"/v1/responses/{plain['id']}/cancel")
    assert response.status_code == 400 and "Only background" in response.json()["error"]["message"]
    assert client.post("/v1/responses/resp_nope/cancel").status_code == 404


def test_a_background_response_still_running_at_shutdown_is_not_left_pending(app, engine):
    from fastapi.testclient import TestClient

    engine.hang_after_first_delta = True
    with TestClient(app) as client:
        body = _respond(client, background=True).json()
        _poll(client, body["id"], {"in_progress"})
    stored = app.state.response_store.get(body["id"])
    assert json.loads(stored.response_json)["status"] == "cancelled"
    assert not app.state.background_responses.is_running(body["id"])


def test_a_background_response_aborted_by_its_request_id_is_stored_cancelled(client, engine):
    engine.hang_after_first_delta = True
    queued = _respond(client, background=True)
    body = queued.json()
    _poll(client, body["id"], {"in_progress"})
    aborted = client.post("/abort_request", json={"rid": queued.headers["x-request-id"]})
    assert aborted.status_code == 200
    cancelled = _poll(client, body["id"], {"cancelled", "completed"})
    assert cancelled["status"] == "cancelled" and cancelled["incomplete_details"] is None
