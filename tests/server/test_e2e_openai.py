"""End to end: `pagedserve serve` with the real default model on 127.0.0.1, driven by the official
`openai` client; then SIGTERM must end an open stream with a final event and exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
STARTUP_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, subprocess.Popen]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "512", "--api-key", "test-key", "--timeout-graceful-shutdown", "2"],
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    assert process.poll() is None, "the server exited during startup"
    yield url, process
    if process.poll() is None:
        process.kill()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="test-key", max_retries=0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_completion(client):
    completion = client.completions.create(model=_model(client), prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 8


def test_chat_completion_is_greedy_deterministic(client):
    def ask() -> str:
        response = client.chat.completions.create(
            model=_model(client), messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=16, temperature=0)
        assert response.choices[0].finish_reason in ("stop", "length")
        return response.choices[0].message.content

    assert ask() == ask()


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=16, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_errors_map_to_openai_exceptions(client, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=_model(client), prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    bad_key = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_sigterm_ends_open_streams_and_exits_zero(server):
    url, process = server
    body = {"prompt": "Once upon a time", "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    headers = {"authorization": "Bearer test-key"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert process.wait(timeout=30) == 0
