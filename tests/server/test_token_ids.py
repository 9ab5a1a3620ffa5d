"""vLLM's token tracing fields: `return_token_ids` (the prompt's token ids and each choice's, beside
the text, streamed as the ids each chunk adds) and `return_tokens_as_token_ids` (logprob tokens
named `token_id:<id>`)."""

from __future__ import annotations

import pytest

from tests.server.conftest import EOS_TOKEN_ID, sse_json

USER = [{"role": "user", "content": "hi"}]
CHAT_PROMPT = list(b"<user>hi\n<assistant>")  # the fake template, byte tokens
LETTERS = list(b"abcdefgh")


def test_completions_return_each_prompt_and_choice_token_ids(client):
    response = client.post(
        "/v1/completions",
        json={"prompt": ["ab", "xyz"], "max_tokens": 3, "n": 2, "return_token_ids": True},
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [choice["prompt_token_ids"] for choice in choices] == [list(b"ab")] * 2 + [
        list(b"xyz")
    ] * 2
    # Choice i writes "abcdefgh"[i:]; the ids are the tokens themselves, whatever their text.
    assert [choice["token_ids"] for choice in choices] == [LETTERS[:3], LETTERS[1:4]] * 2
    assert [choice["text"] for choice in choices] == ["abc", "bcd"] * 2


def test_completion_token_ids_include_the_stop_token_whose_text_is_left_out(client):
    body = client.post(
        "/v1/completions", json={"prompt": "ab", "max_tokens": 12, "return_token_ids": True}
    ).json()
    (choice,) = body["choices"]
    assert choice["text"] == "abcdefgh" and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [*LETTERS, EOS_TOKEN_ID]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]


def test_streamed_completions_send_the_prompt_ids_first_then_each_chunk_s_own(client):
    response = client.post(
        "/v1/completions",
        json={"prompt": "ab", "max_tokens": 12, "n": 2, "stream": True, "return_token_ids": True},
    )
    chunks = [event["choices"][0] for event in sse_json(response.text)]
    for index in (0, 1):
        own = [chunk for chunk in chunks if chunk["index"] == index]
        assert own[0]["prompt_token_ids"] == list(b"ab")
        assert all("prompt_token_ids" not in chunk for chunk in own[1:])
        streamed = [token for chunk in own for token in chunk["token_ids"]]
        # The EOS token has no text, and still its own chunk with its id.
        assert streamed == [*LETTERS[index:], EOS_TOKEN_ID]
        assert "".join(chunk["text"] for chunk in own) == "abcdefgh"[index:]


def test_chat_returns_the_rendered_prompt_ids_and_each_choice_s_ids(client):
    body = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2, "n": 2, "return_token_ids": True},
    ).json()
    assert body["prompt_token_ids"] == CHAT_PROMPT
    assert client.post("/tokenize", json={"messages": USER}).json()["tokens"] == CHAT_PROMPT
    assert [choice["token_ids"] for choice in body["choices"]] == [LETTERS[:2], LETTERS[1:3]]


def test_streamed_chat_puts_prompt_ids_on_the_role_chunks_and_ids_on_every_delta(client):
    response = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 12, "stream": True, "return_token_ids": True},
    )
    events = sse_json(response.text)
    role, *rest = events
    assert role["prompt_token_ids"] == CHAT_PROMPT and role["choices"][0]["delta"]["role"]
    assert all("prompt_token_ids" not in event for event in rest)
    streamed = [token for event in rest for token in event["choices"][0]["token_ids"]]
    assert streamed == [*LETTERS, EOS_TOKEN_ID]
    assert rest[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_token_ids_appear_only_when_asked_for(client, route, stream):
    body = {"prompt": "ab"} if route == "/v1/completions" else {"messages": USER}
    response = client.post(route, json={**body, "max_tokens": 2, "stream": stream})
    assert response.status_code == 200, response.text
    assert "token_ids" not in response.text  # neither prompt_token_ids nor token_ids


def test_completion_logprobs_name_tokens_by_id_when_asked(client):
    body = client.post(
        "/v1/completions",
        json={
            "prompt": "ab",
            "max_tokens": 2,
            "logprobs": 2,
            "echo": True,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    logprobs = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "ababc"[:4]  # echo + the choice's text
    assert logprobs["tokens"] == [f"token_id:{token}" for token in b"abab"]
    assert logprobs["top_logprobs"][0] is None  # the prompt's first token
    assert set(logprobs["top_logprobs"][-1]) == {f"token_id:{ord('b')}", f"token_id:{ord('z')}"}
    assert logprobs["text_offset"] == [0, 1, 2, 3]  # offsets still count the text


def test_chat_logprobs_name_tokens_by_id_and_keep_their_bytes(client):
    body = client.post(
        "/v1/chat/completions",
        json={
            "messages": USER,
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    (entry,) = body["choices"][0]["logprobs"]["content"]
    assert entry["token"] == f"token_id:{ord('a')}" and entry["bytes"] == [ord("a")]
    assert [top["token"] for top in entry["top_logprobs"]] == [
        f"token_id:{ord('a')}",
        f"token_id:{ord('z')}",
    ]
