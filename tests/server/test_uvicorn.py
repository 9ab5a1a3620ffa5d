"""The app under a real uvicorn (on 127.0.0.1, fake engine): disconnects and shutdown over TCP."""

from __future__ import annotations

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
