"""Non-streaming routes against the fake engine: completions, chat, models, tokenize, health."""

from __future__ import annotations

import logging
import re
import time

import pytest
from jinja2 import TemplateError

USER_MESSAGE = {"role": "user", "content": "hi"}


def test_completion_returns_choices_usage_and_openai_fields(client):
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2})
    assert response.status_code == 200
    body = response.json()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "abc", "length"),
        (1, "bcd", "length"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 6,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_defaults_to_16_tokens_and_stops_at_eos(client, engine):
    body = client.post("/v1/completions", json={"prompt": "hi"}).json()
    assert body["choices"][0] == {
        "index": 0,
        "text": "abcdefgh",
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,  # vLLM's: EOS is no stop string or stop token id
    }
    assert engine.requests[0][2].max_tokens == 16


def test_completion_batch_indexes_choices_by_prompt_then_n(client, engine):
    body = client.post(
        "/v1/completions", json={"prompt": [[104, 105], [120]], "max_tokens": 1, "n": 2}
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert sorted(request[1] for request in engine.requests) == [[104, 105], [120]]
    assert body["usage"]["prompt_tokens"] == 3


def test_completion_legacy_logprobs_have_offsets_and_top_entries(client):
    body = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 2}
    ).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"a": -0.5, "z": -1.5}, {"b": -0.5, "z": -1.5}],
        "text_offset": [0, 1],
    }


def test_completion_echo_prepends_the_prompt(client):
    body = client.post(
        "/v1/completions", json={"prompt": "hi ", "max_tokens": 2, "echo": True}
    ).json()
    assert body["choices"][0]["text"] == "hi ab"


def test_completion_passes_sampling_fields_to_the_engine(client, engine):
    client.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 2,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "min_p": 0.1,
            "seed": 7,
            "stop": "x",
            "stop_token_ids": [1],
            "logit_bias": {"5": 1.0},
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "allowed_token_ids": [97, 98],
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "user": "u",
            "best_of": 1,
        },
    )
    params = engine.requests[0][2]
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (
        0.0,
        0.5,
        3,
        0.1,
        7,
    )
    assert params.stop == ("x",) and params.stop_token_ids == (1,)
    assert params.logit_bias == {5: 1.0} and params.min_tokens == 1
    assert params.include_stop_str_in_output and params.repetition_penalty == 1.1
    assert not params.skip_special_tokens and params.allowed_token_ids == (97, 98)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_the_models_sampling_defaults_fill_the_fields_a_request_leaves_out(client, engine, route):
    engine.sampling_defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    body = {"prompt": "hi"} if route == "/v1/completions" else {"messages": [USER_MESSAGE]}
    client.post(route, json={**body, "max_tokens": 1})
    client.post(route, json={**body, "max_tokens": 1, "temperature": 1.0, "top_k": None})
    (_, _, implicit), (_, _, explicit) = engine.requests
    assert (implicit.temperature, implicit.top_p, implicit.top_k) == (0.6, 0.95, 20)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.0, 0.95, 20)
    assert implicit.repetition_penalty == 1.0  # the model sets none: the API's default


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_created_is_when_the_request_arrived_not_its_first_token(client, engine, route):
    engine.first_delta_delay_s = 2.1  # a first token more than two seconds after arrival
    body = {"prompt": "hi"} if route == "/v1/completions" else {"messages": [USER_MESSAGE]}
    sent = time.time()
    response = client.post(route, json={**body, "max_tokens": 2})
    assert response.json()["created"] <= int(sent) + 1  # at most a second boundary later


def test_usage_counts_each_prompts_cached_tokens_once(client, engine):
    engine.num_cached_prompt_tokens = 1  # on each choice's final delta
    body = client.post("/v1/completions", json={"prompt": ["hi", "yo"], "n": 2}).json()
    assert len(body["choices"]) == 4
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_null_optional_fields_mean_their_defaults_like_openai(client):
    response = client.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 1,
            "stream": None,
            "echo": None,
            "min_tokens": None,
            "ignore_eos": None,
            "stream_options": None,
            "logprobs": None,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "a"  # not echoed, not streamed
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi", "name": None}],
            "max_tokens": 1,
            "logprobs": None,
            "stream": None,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None


def test_a_chat_template_that_rejects_the_conversation_is_a_400(client, engine, monkeypatch):
    def strict_template(conversation, add_generation_prompt, tokenize):
        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant")

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", strict_template)
    response = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "must alternate" in error["message"]


def test_chat_applies_the_template_and_defaults_to_the_remaining_context(client, engine):
    body = client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        },
    ).json()
    _, prompt_ids, params = engine.requests[0]
    assert bytes(prompt_ids).decode() == "<system>be brief\n<user>hi\n<assistant>"
    assert params.max_tokens == engine.max_model_len - len(prompt_ids)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abcdefgh"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_chat_prefers_max_completion_tokens(client, engine):
    body = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "max_completion_tokens": 2,
        },
    ).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert engine.requests[0][2].max_tokens == 2


def test_chat_logprobs_use_the_chat_format(client):
    body = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 1,
        },
    ).json()
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
            }
        ]
    }


def test_models_lists_the_served_model(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert client.get("/v1/models/other").status_code == 404


def test_health_follows_the_engine(client, engine):
    assert client.get("/health").status_code == 200
    engine.is_alive = False
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"


def test_version_reports_a_version(client):
    assert isinstance(client.get("/version").json()["version"], str)


def test_tokenize_prompt_and_messages(client):
    assert client.post("/tokenize", json={"prompt": "hi"}).json() == {
        "tokens": [104, 105],
        "count": 2,
        "max_model_len": 64,
    }
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert bytes(chat["tokens"]).decode() == "<user>x\n<assistant>"
    prefilled = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    continued = client.post(
        "/tokenize",
        json={
            "messages": prefilled,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"v": 1},
        },
    ).json()
    assert bytes(continued["tokens"]).decode() == "[v=1]<user>x\n<assistant>y"


def test_tokenize_counts_chat_tools_and_returns_token_strings_when_asked(client, engine):
    engine.max_model_len = 4096  # the fallback tools block alone is ~800 byte tokens
    messages = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    plain = client.post("/tokenize", json={"messages": messages}).json()
    with_tools = client.post("/tokenize", json={"messages": messages, "tools": [tool]}).json()
    assert with_tools["count"] > plain["count"]  # as chat renders them (the fallback block)
    assert "get_weather" in bytes(with_tools["tokens"]).decode()
    strs = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["h", "i"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template_kwargs", {"v": 1}),
    ],
)
def test_tokenize_refuses_chat_controls_with_a_plain_prompt(client, field, value):
    response = client.post("/tokenize", json={"prompt": "hi", field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_tokenize_refuses_a_client_chat_template_rather_than_ignoring_it(client):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}
    response = client.post("/tokenize", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"


def test_detokenize_round_trips(client):
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}


def test_lifespan_starts_and_shuts_down_the_engine(app, engine):
    from fastapi.testclient import TestClient

    with TestClient(app):
        assert engine.started and not engine.shut_down
    assert engine.shut_down


def test_every_response_carries_a_request_id(client):
    assert re.fullmatch(r"[0-9a-f]{32}", client.get("/health").headers["x-request-id"])


def test_priority_reaches_the_engine_for_every_prompt_under_the_priority_policy(client, engine):
    engine.scheduling_policy = "priority"
    response = client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "priority": -2}
    )
    assert response.status_code == 200, response.text
    assert sorted(engine.priorities.values()) == [-2, -2]


def test_priority_under_fcfs_is_a_400_naming_the_field(client):
    response = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "priority": 1},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "priority"


def test_a_prompt_refused_as_overloaded_closes_the_prompts_already_accepted(client, engine):
    engine.in_flight = engine.max_waiting_requests - 1  # room for one more engine request
    engine.hang_after_first_delta = True  # the accepted prompt is still running when refused
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 4})
    assert response.status_code == 429, response.text
    ((accepted, _, _),) = engine.requests
    assert accepted in engine.closed_early  # closing its stream is what aborts it in AsyncEngine


def test_every_served_model_name_is_accepted_and_listed(client_with, engine):
    engine.served_model_names = ("fake-model", "alias")
    client = client_with()
    body = client.post("/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 1})
    assert body.status_code == 200 and body.json()["model"] == "fake-model"  # vLLM: the first
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [
        "fake-model",
        "alias",
    ]
    assert client.get("/v1/models/alias").status_code == 200
    assert (
        client.post("/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404
    )


@pytest.mark.parametrize("log_requests", [True, False])
def test_each_finished_request_is_one_log_line_unless_turned_off(client_with, caplog, log_requests):
    client = client_with(log_requests=log_requests)
    with caplog.at_level(logging.INFO):
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    lines = [r for r in caplog.records if r.name == "pagedserve.server.recorder"]
    assert len(lines) == (1 if log_requests else 0)
