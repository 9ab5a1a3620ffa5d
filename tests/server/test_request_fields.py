"""Fields beyond the ones the server reads (server/request_fields.py), and vLLM's chat template
and tokenization controls (server/prompts.py)."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from tests.server.conftest import make_config, sse_json

TAG = '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'

USER = [{"role": "user", "content": "hi"}]
ROUTES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 1},
}

ASKING = [
    ("spaces_between_special_tokens", 0),  # not `true`: a number asks for something unknown
    ("spaces_between_special_tokens", False),
    ("guided_whitespace_pattern", " "),
    ("chat_template", "{{ messages }}"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("field", "value"), ASKING)
def test_an_unsupported_field_that_asks_for_something_is_a_400_naming_it(
    client, engine, route, field, value
):
    response = client.post(route, json={**ROUTES[route], field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "not supported" in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto")],
)
def test_chat_refuses_legacy_function_calling(client, field, value):
    response = client.post(
        "/v1/chat/completions", json={**ROUTES["/v1/chat/completions"], field: value}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    if field == "functions":
        assert "tools" in response.json()["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_unsupported_fields_sent_with_their_neutral_value_are_accepted(client, route):
    neutral = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "spaces_between_special_tokens": True,
        "return_token_ids": False,
        "logits_processors": [],
        "prompt_embeds": None,
    }
    response = client.post(route, json={**ROUTES[route], **neutral})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_fields_are_ignored_and_logged(client, route, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedserve.server.request_fields"):
        response = client.post(
            route, json={**ROUTES[route], "future_field": {"x": 1}, "temprature": 0.5}
        )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert any(
        request_id in record.getMessage() and "future_field, temprature" in record.getMessage()
        for record in caplog.records
    )


def _chat_prompt(client, engine, **fields) -> str:
    messages = fields.pop("messages", USER)
    response = client.post("/v1/chat/completions", json={"messages": messages, **fields})
    assert response.status_code == 200, response.text
    return bytes(t for t in engine.requests[-1][1] if t < 256).decode()


def test_add_generation_prompt_false_leaves_the_assistant_turn_closed(client, engine):
    assert _chat_prompt(client, engine) == "<user>hi\n<assistant>"
    assert _chat_prompt(client, engine, add_generation_prompt=False) == "<user>hi\n"


def test_continue_final_message_leaves_the_prefill_open(client, engine):
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    prompt = _chat_prompt(
        client, engine, messages=messages, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt == "<user>hi\n<assistant>The answer is"


def test_continue_final_message_with_a_new_turn_is_a_400(client, engine):
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    response = client.post(
        "/v1/chat/completions", json={"messages": messages, "continue_final_message": True}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "continue_final_message"
    assert engine.requests == []


def test_chat_template_kwargs_reach_the_template(client, engine):
    prompt = _chat_prompt(client, engine, chat_template_kwargs={"enable_thinking": False})
    assert prompt == "[enable_thinking=False]<user>hi\n<assistant>"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokenize": True},
        {"tools": []},
        {"add_generation_prompt": 0},
        {"messages": []},  # what transformers renders the template with
        {"conversations": []},
        {"self": 1},
    ],
)
def test_chat_template_kwargs_may_not_set_how_the_template_is_applied(client, kwargs):
    response = client.post(
        "/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": kwargs}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and next(iter(kwargs)) in error["message"]


def test_a_template_that_cannot_take_a_variable_is_a_400_naming_chat_template_kwargs(
    client, engine, monkeypatch
):
    def template(conversation, add_generation_prompt, tokenize, enable_thinking):
        raise AssertionError("not called: the variable's name is wrong")

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", template)
    response = client.post(
        "/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {"thinking": 1}}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_must_be_an_object(client):
    response = client.post(
        "/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": ["x"]}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"


BOS = 256


@pytest.fixture
def bos_tokenizer(engine, monkeypatch):
    """The fake tokenizer, adding a BOS where special tokens are asked for."""
    encode = engine.tokenizer.encode

    def encode_with_bos(text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS] * add_special_tokens + encode(text)

    monkeypatch.setattr(engine.tokenizer, "encode", encode_with_bos)


def test_completions_add_special_tokens_by_default_and_not_when_told(client, engine, bos_tokenizer):
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "add_special_tokens": False}
    )
    assert [request[1] for request in engine.requests] == [[BOS, *b"hi"], [*b"hi"]]


def test_chat_adds_no_special_tokens_unless_told(client, engine, bos_tokenizer):
    assert engine.requests == []
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
    client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "add_special_tokens": True}
    )
    assert [request[1][0] for request in engine.requests] == [ord("<"), BOS]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, engine):
    body = {"prompt": "hello world", "max_tokens": 1, "echo": True}
    cut = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 5}).json()
    whole = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).json()
    assert [bytes(request[1]) for request in engine.requests] == [b"world", b"hello world"]
    assert cut["choices"][0]["text"] == "worlda" and cut["usage"]["prompt_tokens"] == 5
    assert whole["choices"][0]["text"] == "hello worlda"
    client.post("/v1/chat/completions", json={"messages": USER, "truncate_prompt_tokens": 4})
    assert bytes(engine.requests[-1][1]) == b"\n<assistant>"[-4:]


@pytest.mark.parametrize("value", [0, -2, "5"])
def test_a_bad_truncate_prompt_tokens_is_a_400(client, value):
    response = client.post(
        "/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": value}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_bad_words_are_tokenized_for_the_engine(client, engine):
    # The byte tokenizer spells " ab" with one token more than "ab": no spaced variant.
    client.post("/v1/completions", json={"prompt": "hi", "bad_words": ["ab", " c"]})
    assert engine.requests[0][2].bad_words_token_ids == ((97, 98), (99,))


@pytest.mark.parametrize("words", [[""], ["  "], ["x" * 257], [f"w{i}" for i in range(17)], "ab"])
def test_bad_bad_words_are_a_400(client, words):
    response = client.post("/v1/completions", json={"prompt": "hi", "bad_words": words})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "bad_words"


def test_cache_salt_reaches_the_engine(client, engine):
    client.post("/v1/chat/completions", json={"messages": USER, "cache_salt": "tenant-a"})
    assert engine.requests[0][2].cache_salt == "tenant-a"


@pytest.mark.parametrize("salt", ["", "x" * 1025, 5])
def test_a_bad_cache_salt_is_a_400(client, salt):
    response = client.post("/v1/completions", json={"prompt": "hi", "cache_salt": salt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"


def test_a_participants_name_reaches_the_template(client, engine):
    messages = [{"role": "user", "content": "hi", "name": "ada"}]
    client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert bytes(engine.requests[0][1]).decode() == "<user:ada>hi\n<assistant>"


@pytest.mark.parametrize("route", ROUTES)
def test_continuous_usage_stats_put_each_choice_s_usage_so_far_in_every_chunk(client, route):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**ROUTES[route], "max_tokens": 3, "n": 2, "stream": True, "stream_options": options}
    text = client.post(route, json=body).text
    events = sse_json(text)
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    prompt_tokens = final["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen[choice["index"]]  # per choice, never back
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 3, 1: 3}


def test_continuous_usage_stats_without_include_usage_is_refused_not_ignored(client):
    options = {"continuous_usage_stats": True}
    body = {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": options}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert "include_usage" in response.json()["error"]["message"]


# --- nested objects -------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"regex": "a", "whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern"),
        ({"regex": "a", "structural_tag": TAG}, "structured_outputs.structural_tag"),  # 2
        ({"regex": "a", "regx": "b"}, "structured_outputs.regx"),  # unknown: refused, as vLLM
        ({"json_schema": {"type": "object"}}, "structured_outputs.json_schema"),
        ({}, "structured_outputs"),  # no constraint at all is a mistake, not free text
        ({"whitespace_pattern": None}, "structured_outputs"),
        ({"json_object": False}, "structured_outputs"),  # constrains nothing either
    ],
)
def test_structured_outputs_refuses_what_it_would_not_apply(client, engine, route, options, param):
    response = client.post(route, json={**ROUTES[route], "structured_outputs": options})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


@pytest.mark.parametrize("flag", ["disable_any_whitespace", "disable_additional_properties"])
@pytest.mark.parametrize("value", [True, False])
def test_structured_outputs_flags_our_json_grammars_satisfy_are_accepted(
    client, engine, flag, value
):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {**ROUTES["/v1/completions"], "structured_outputs": {"json": schema, flag: value}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert engine.requests[-1][2].structured_outputs.kind == "json"


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_keys_of_the_option_objects_are_ignored_and_logged(client, route, caplog):
    body = {
        **ROUTES[route],
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}, "extra_hint": 1},
            "format_version": 2,
        },
    }
    with caplog.at_level(logging.WARNING, logger="pagedserve.server.request_fields"):
        response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    assert any(
        "response_format.format_version, response_format.json_schema.extra_hint, "
        "stream_options.include_obfuscation" in record.getMessage()
        for record in caplog.records
    )


# --- chat echo and the rendered prompt ------------------------------------------------------------

PREFILL = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Well,"},
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def test_chat_echo_starts_the_reply_with_the_assistant_prefill(client):
    body = {"messages": PREFILL, "max_tokens": 2, "echo": True, **CONTINUE}
    response = client.post("/v1/chat/completions", json=body).json()
    assert response["choices"][0]["message"]["content"] == "Well,ab"  # the fake writes "ab..."
    assert response["usage"]["completion_tokens"] == 2  # the echo is not generated
    # After a user's turn there is nothing of the reply's own to echo.
    plain = {"messages": USER, "max_tokens": 2, "echo": True}
    assert (
        client.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]["content"]
        == "ab"
    )


def test_streamed_chat_echo_follows_the_role_chunk(client):
    body = {"messages": PREFILL, "max_tokens": 2, "echo": True, "stream": True, **CONTINUE}
    text = client.post("/v1/chat/completions", json=body).text
    events = sse_json(text)
    deltas = [event["choices"][0]["delta"] for event in events]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "Well,"}
    assert "".join(delta.get("content", "") for delta in deltas) == "Well,ab"


def _reply_roles(client, body: dict) -> tuple[str, str]:
    """The role of a plain reply and of a streamed one's first chunk."""
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    events = sse_json(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    return plain["role"], events[0]["choices"][0]["delta"]["role"]


def test_response_role_names_the_reply_after_a_generation_prompt(client_with):
    # vLLM's --response-role; both shapes of the reply carry it.
    client = client_with(response_role="bot")
    assert _reply_roles(client, {"messages": USER, "max_tokens": 2}) == ("bot", "bot")


def test_a_continued_message_keeps_its_own_role_and_echo_repeats_it(client_with):
    # As vLLM's: without a generation prompt the model continues the last message, whatever its
    # role, so the reply names that role, and echo repeats that message's text.
    client = client_with(response_role="bot")
    body = {"messages": USER, "max_tokens": 2, **CONTINUE}
    assert _reply_roles(client, body) == ("user", "user")
    echoed = client.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "hiab"


def test_an_empty_response_role_is_refused_at_start():
    with pytest.raises(ValidationError, match="response_role"):
        make_config(response_role="")


@pytest.mark.parametrize("stream", [False, True])
def test_return_prompt_text_gives_the_rendered_chat_prompt(client, stream):
    body = {"messages": USER, "max_tokens": 2, "return_prompt_text": True, "stream": stream}
    response = client.post("/v1/chat/completions", json=body)
    rendered = "<user>hi\n<assistant>"  # the fake engine's template
    if not stream:
        assert response.json()["prompt_text"] == rendered
        return
    events = sse_json(response.text)
    assert events[0]["prompt_text"] == rendered
    assert all("prompt_text" not in event for event in events[1:])


# --- stop_regex (SGLang's) --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": USER}),
    ],
)
@pytest.mark.parametrize("value", [r"\d{3}", [r"\d{3}", "(?i)end"]])
def test_stop_regex_reaches_the_engine_as_patterns(client, engine, path, body, value):
    response = client.post(path, json={**body, "max_tokens": 2, "stop_regex": value})
    assert response.status_code == 200, response.text
    expected = (value,) if isinstance(value, str) else tuple(value)
    assert engine.requests[-1][2].stop_regex == expected


def test_stop_regex_on_generate_reaches_the_engine(client, engine):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop_regex": ["a{2}"]}}
    assert client.post("/generate", json=body).status_code == 200
    assert engine.requests[-1][2].stop_regex == ("a{2}",)


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", "not a valid RE2 pattern: invalid escape sequence"),  # a backreference
        ("(?<=a)b", "not a valid RE2 pattern"),  # lookbehind: RE2 does not backtrack
        ("x|", "can match the empty string"),
        (r"x*\b", "can match the empty string"),  # at a word boundary
        ("[a-", "not a valid RE2 pattern: missing ]"),
        ("a" * 1025, "at most 1024 characters"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stop_regex_re2_cannot_take_is_a_400_naming_the_field(
    client, engine, path, pattern, reason
):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": USER}
    before = len(engine.requests)
    response = client.post(path, json={**body, "stop_regex": pattern})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop_regex" and reason in error["message"]
    assert len(engine.requests) == before  # nothing reached the engine
