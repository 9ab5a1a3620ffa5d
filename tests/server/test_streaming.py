"""Server-Sent Events in OpenAI's exact chunk format, usage chunks, and in-stream errors."""

from __future__ import annotations

import json

from pagedserve.engine.errors import EngineDeadError

USER = [{"role": "user", "content": "hi"}]


def _events(response) -> list[str]:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n")
    blocks = response.text.split("\n\n")[:-1]
    assert all(block.startswith("data: ") for block in blocks)
    return [block.removeprefix("data: ") for block in blocks]


def _chunks(response) -> list[dict]:
    events = _events(response)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(event) for event in events[:-1]]


def test_completion_stream_chunks_then_done(client):
    chunks = _chunks(
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    )
    assert len({chunk["id"] for chunk in chunks}) == 1
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "choices"}  # no usage key
        assert chunk["object"] == "text_completion"
        (choice,) = chunk["choices"]
        final = {"stop_reason"} if choice["finish_reason"] else set()  # vLLM's, with the reason
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", *final}
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "abc"
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, "length"]


def test_completion_stream_with_usage_ends_with_a_usage_chunk(client):
    chunks = _chunks(
        client.post(
            "/v1/completions",
            json={
                "prompt": "hi",
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_stream_logprobs_offsets_continue_across_chunks(client):
    chunks = _chunks(
        client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True, "logprobs": 0}
        )
    )
    assert [chunk["choices"][0]["logprobs"]["text_offset"] for chunk in chunks] == [[0], [1], [2]]
    assert chunks[0]["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.5}]


def test_completion_stream_echo_sends_the_prompt_first(client):
    chunks = _chunks(
        client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True, "echo": True}
        )
    )
    assert [chunk["choices"][0]["text"] for chunk in chunks] == ["hia", "b"]


def test_chat_stream_sends_the_role_first_then_content_then_finish(client):
    chunks = _chunks(
        client.post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True}
        )
    )
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert [chunk["choices"][0]["delta"] for chunk in chunks[1:]] == [
        {"content": "a"},
        {"content": "b"},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_with_n_and_usage(client):
    chunks = _chunks(
        client.post(
            "/v1/chat/completions",
            json={
                "messages": USER,
                "max_tokens": 2,
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    assert [chunk["choices"][0]["delta"].get("role") for chunk in chunks[:2]] == ["assistant"] * 2
    assert all("usage" in chunk and chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_chat_stream_ends_with_stop_at_eos(client):
    chunks = _chunks(client.post("/v1/chat/completions", json={"messages": USER, "stream": True}))
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }


def test_error_after_the_first_byte_is_an_error_event_then_done(client, engine):
    engine.fail_after_first_delta = EngineDeadError("engine stopped")
    events = _events(client.post("/v1/chat/completions", json={"messages": USER, "stream": True}))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "engine stopped" and error["code"] == "engine_dead"
    assert set(error) == {"message", "type", "param", "code"}
