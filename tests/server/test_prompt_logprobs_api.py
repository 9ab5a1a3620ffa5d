"""Prompt logprobs through the HTTP API (fake engine: prompt token i scores -i/10 with "z" as its
alternative; see `fake_prompt_logprobs`): `echo` + `logprobs` put the prompt first in OpenAI's
legacy lists, `max_tokens: 0` returns only the echoed prompt, and vLLM's `prompt_logprobs`
appears on completion choices and on chat responses."""

from __future__ import annotations

import json

import pytest


def _complete(client, **fields):
    response = client.post("/v1/completions", json={"prompt": "hi", **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_lists_the_prompt_tokens_first(client, engine):
    body = _complete(client, max_tokens=2, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == "hiab"
    assert choice["logprobs"] == {
        "tokens": ["h", "i", "a", "b"],
        "token_logprobs": [None, -0.1, -0.5, -0.5],
        "top_logprobs": [None, {"z": -0.05, "i": -0.1}, {"a": -0.5}, {"b": -0.5}],
        "text_offset": [0, 1, 2, 3],
    }
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for
    assert engine.requests[0][2].prompt_logprobs == 1
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(
    "prompt, texts",
    [
        ("hi", ["hi"]),
        ([104, 105], ["hi"]),
        (["hi", "yo!"], ["hi", "yo!"]),
        ([[104, 105], [121]], ["hi", "y"]),
    ],
)
def test_max_tokens_zero_with_echo_returns_only_the_prompt(client, engine, prompt, texts):
    body = _complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert [choice["text"] for choice in body["choices"]] == texts
    assert [choice["finish_reason"] for choice in body["choices"]] == ["length"] * len(texts)
    for choice, text in zip(body["choices"], texts, strict=True):
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == text
        assert logprobs["token_logprobs"] == [None] + [-i / 10 for i in range(1, len(text))]
    num_prompt_tokens = sum(len(text.encode()) for text in texts)
    assert body["usage"] == {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": 0,
        "total_tokens": num_prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(params.max_tokens == 0 for _, _, params in engine.requests)


def test_max_tokens_zero_with_a_bare_echo_returns_the_prompt_without_logprobs(client, engine):
    body = _complete(client, max_tokens=0, echo=True)
    assert body["choices"][0]["text"] == "hi" and body["choices"][0]["logprobs"] is None


def test_max_tokens_zero_without_echo_is_a_400(client):
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_completion_prompt_logprobs_come_in_vllm_shape(client, engine):
    body = _complete(client, max_tokens=1, prompt_logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == "a" and choice["logprobs"] is None
    assert choice["prompt_logprobs"] == [
        None,
        {
            "122": {"logprob": -0.05, "rank": 1, "decoded_token": "z"},
            "105": {"logprob": -0.1, "rank": 1, "decoded_token": "i"},
        },
    ]


def test_chat_prompt_logprobs_are_on_the_response(client, engine):
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
    )
    body = response.json()
    prompt = "<user>x\n<assistant>"
    assert len(body["prompt_logprobs"]) == len(prompt) and body["prompt_logprobs"][0] is None
    assert body["prompt_logprobs"][1] == {
        str(ord("u")): {"logprob": -0.1, "rank": 1, "decoded_token": "u"}
    }


def test_streaming_echo_with_logprobs_sends_the_prompt_in_the_first_chunk(client):
    response = client.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "stream": True, "echo": True, "logprobs": 0},
    )
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert [chunk["text"] for chunk in chunks] == ["hia", "b"]
    assert chunks[0]["logprobs"]["tokens"] == ["h", "i", "a"]
    assert chunks[0]["logprobs"]["token_logprobs"] == [None, -0.1, -0.5]
    assert chunks[0]["logprobs"]["text_offset"] == [0, 1, 2]
    assert chunks[1]["logprobs"]["text_offset"] == [3]


def test_streamed_prompt_logprobs_are_a_400(client):
    response = client.post(
        "/v1/completions", json={"prompt": "hi", "stream": True, "prompt_logprobs": 1}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"
