"""SageMaker's contract against the fake engine: /ping is the health check (no API key, as
/health), /invocations answers each kind of request as its own route does, names a bad field as
that route would, and says which fields it routes by when it knows none."""

from __future__ import annotations

import pytest

USER = [{"role": "user", "content": "hi"}]


def test_ping_is_the_health_check_without_a_key(client_with, engine):
    client = client_with(api_key="k")
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    engine.is_alive = False
    assert client.get("/ping").status_code == 503


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"messages": USER, "max_tokens": 2}, "/v1/chat/completions"),
        ({"prompt": "hi", "max_tokens": 2}, "/v1/completions"),
        ({"input": "hi"}, "/v1/embeddings"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 2}}, "/generate"),
        ({"query": "a", "documents": ["b", "c"]}, "/rerank"),
        ({"text_1": "a", "text_2": ["b"]}, "/score"),
    ],
)
def test_invocations_answers_as_the_request_s_own_route(client, body, path):
    direct, invoked = client.post(path, json=body), client.post("/invocations", json=body)
    assert invoked.status_code == 200, invoked.text
    assert _stable(invoked.json()) == _stable(direct.json())


def _stable(answer: dict) -> dict:
    """The answer without what differs from one request to the next (ids, times)."""
    volatile = {"id", "created", "e2e_latency"}
    if isinstance(answer, dict):
        return {key: _stable(value) for key, value in answer.items() if key not in volatile}
    return answer


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"model": "fake-model"}', "give messages (chat)"),
    ],
)
def test_invocations_says_what_it_cannot_route(client, content, says):
    response = client.post("/invocations", content=content)
    assert response.status_code == 400 and says in response.json()["error"]["message"]


def test_invocations_names_a_bad_field_as_the_route_does(client):
    response = client.post("/invocations", json={"messages": USER, "max_tokens": "two"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
