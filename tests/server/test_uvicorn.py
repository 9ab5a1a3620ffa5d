"""The app under a real uvicorn (on 127.0.0.1, fake engine): disconnects and shutdown over TCP."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from pagedserve.server.cli import GracefulServer


@pytest.fixture
def served(app, engine) -> Iterator[tuple[str, object, uvicorn.Server]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
    )
    server = GracefulServer(config, grace_s=0.2)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", engine, server
    server.should_exit = True
    thread.join(timeout=10)


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_closing_a_stream_aborts_the_engine_request(served):
    url, engine, _ = served
    engine.hang_after_first_delta = True
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=5) as response:
        assert next(response.iter_lines()).startswith("data: ")
    assert _wait_for(lambda: engine.aborted == [engine.requests[0][0]])
    assert engine.closed_early == engine.aborted


def test_shutdown_ends_open_streams_with_a_final_event(served):
    url, engine, server = served
    engine.hang_after_first_delta = True
    body = {"prompt": "hi", "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.should_exit = True  # what SIGTERM does; open streams get the graceful timeout
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert '"code": "shutting_down"' in rest[-2]
    assert _wait_for(lambda: engine.shut_down)
    assert engine.aborted == [engine.requests[0][0]]


def _data(line: str) -> dict:
    return json.loads(line.removeprefix("data: "))


def test_abort_request_ends_a_streamed_generate_with_an_abort_finish(served):
    url, engine, _ = served
    engine.hang_after_first_delta = True
    body = {"text": "hi", "rid": "job", "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=5) as response:
        lines = (line for line in response.iter_lines() if line)
        assert _data(next(lines))["meta_info"]["finish_reason"] is None
        aborted = httpx.post(f"{url}/abort_request", json={"rid": "job"}, timeout=5)
        assert (aborted.status_code, aborted.text) == (200, "")
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    last = _data(rest[-2])
    assert last["text"] == "a" and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.aborted == ["job"]


def test_abort_request_by_x_request_id_and_abort_all_reach_openai_requests(served):
    url, engine, _ = served
    engine.hang_after_first_delta = True
    body = {"prompt": ["a", "b"], "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=5) as response:
        lines = (line for line in response.iter_lines() if line)
        next(lines)
        request_id = response.headers["x-request-id"]
        httpx.post(f"{url}/abort_request", json={"rid": request_id}, timeout=5)
        reasons = [_data(line)["choices"][0]["finish_reason"] for line in lines if "{" in line]
    assert reasons.count("abort") == 2 and sorted(engine.aborted) == [
        f"{request_id}-0",
        f"{request_id}-1",
    ]
    engine.aborted.clear()
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=5)
        )
    )
    thread.start()
    assert _wait_for(lambda: engine.in_flight == 1)
    assert httpx.post(f"{url}/abort_request", json={"abort_all": True}).status_code == 200
    thread.join(timeout=5)
    assert answers[0].status_code == 200  # as SGLang: what it had, finished as aborted
    assert answers[0].json()["choices"][0]["finish_reason"] == "abort"
    assert len(engine.aborted) == 1
