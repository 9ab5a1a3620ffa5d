"""Every error is OpenAI's body with the right status: bad requests, auth, limits, engine errors."""

from __future__ import annotations

import pytest

from pagedserve.engine.errors import EngineDeadError, EngineOverloadedError, RequestFailedError

USER = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (route, json body or raw bytes, status, param)
    ("/v1/completions", b'{"prompt": "hi",', 400, None),
    ("/v1/completions", b'{"prompt": "\xff"}', 400, None),
    ("/v1/completions", b'["hi"]', 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 63}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 64}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [1, 258]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u0663": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ["a"] * 9}, 400, "prompt"),  # the fake queues 8 at most
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', 404, "model"),  # lone surrogate
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "stream": False, "stream_options": {}},
        400,
        "stream_options",
    ),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("/v1/completions", {"prompt": "hi", "priority": "high"}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        400,
        "messages[0].content",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": USER, "top_logprobs": 21, "logprobs": True},
        400,
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 100}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * 60}]},
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"messages": USER, "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [300]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize(("route", "payload", "status", "param"), BAD_REQUESTS)
def test_bad_request_gets_an_openai_error_body(client, route, payload, status, param):
    if isinstance(payload, bytes):
        response = client.post(route, content=payload, headers={"content-type": "application/json"})
    else:
        response = client.post(route, json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_too_long_request_states_both_lengths(client):
    message = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 63}).json()[
        "error"
    ]["message"]
    assert "64" in message and "65" in message
    message = client.post("/v1/completions", json={"prompt": "x" * 70}).json()["error"]["message"]
    assert "64" in message and "70" in message


def test_unknown_route_and_wrong_method_are_openai_errors(client):
    assert client.get("/v1/nothing").json()["error"]["code"] == "not_found"
    response = client.delete("/v1/models")
    assert response.status_code == 405 and "error" in response.json()


@pytest.mark.parametrize(
    ("exc", "status", "error_type"),
    [
        (EngineOverloadedError("busy"), 429, "rate_limit_error"),
        (EngineDeadError("dead"), 503, "server_error"),
        (RequestFailedError("failed"), 500, "server_error"),
    ],
)
def test_engine_errors_map_to_statuses(client, engine, exc, status, error_type):
    engine.raise_on_generate = exc
    for stream in (False, True):
        response = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert response.status_code == status
        assert response.json()["error"]["type"] == error_type


def test_unexpected_error_is_a_500_without_traceback(client, engine):
    engine.raise_on_generate = KeyError("secret internals")
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert "secret" not in response.text and "Traceback" not in response.text
    assert response.headers["connection"] == "close"  # the server drops it after this reply


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "secret"}]
)
def test_missing_or_wrong_api_key_is_401(client_with, headers):
    client = client_with(api_key="secret")
    for method, route in [
        ("post", "/v1/completions"),
        ("get", "/v1/models"),
        ("post", "/tokenize"),
        ("get", "/v1/unknown"),
    ]:
        response = getattr(client, method)(route, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_valid_api_key_passes_and_probes_need_none(client_with):
    client = client_with(api_key="secret")
    auth = {"authorization": "Bearer secret"}
    assert client.post("/v1/completions", json={"prompt": "hi"}, headers=auth).status_code == 200
    for route in ("/health", "/version", "/metrics"):
        assert client.get(route).status_code == 200


def test_oversized_body_is_413_by_content_length(client_with):
    client = client_with(max_request_body_bytes=1024)
    response = client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_oversized_chunked_body_is_413_while_reading(client_with):
    client = client_with(max_request_body_bytes=1024)

    def chunks():  # no Content-Length: the limit must hold while the body is read
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    response = client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"
