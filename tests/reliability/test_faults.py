"""Faults against the real engine, in process (create_app + AsyncEngine under uvicorn on
127.0.0.1, tiny KV pool): client disconnects and aborts while waiting, prefilling and decoding, a
sampler that raises for one request, a forward pass that raises, and an oversubscribed pool. The
failing request gets an error, every other request completes correctly, and every block returns.

To abort at a chosen phase, the engine thread is paused between steps (`StepGate`): while paused
it still applies add/abort commands but schedules nothing, so the phase cannot move on.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from pagedserve.configs import load_engine_config
from pagedserve.scheduler import RequestStatus
from pagedserve.server.app import create_app
from pagedserve.server.cli import GracefulServer
from tests.reliability.support import (
    STARTUP_TIMEOUT_S,
    assert_completion,
    assert_openai_error,
    free_port,
    parse_sse,
    read_metrics,
)

NUM_BLOCKS, BLOCK_SIZE = 16, 4  # 64 KV slots: a handful of short requests oversubscribe it
SENTINEL_SEED = 31337  # the sampler fault fires only for requests with this seed
PROMPT_60_TOKENS = "one two three four five six seven eight nine ten " * 6


class StepGate:
    """Wraps `LLMEngine.step`: while paused the engine thread keeps applying commands but runs no
    step; `allow(n)` lets exactly n more steps run, then pauses again."""

    def __init__(self, llm: Any) -> None:
        self._original = llm.step
        self._lock = threading.Lock()
        self._credits: int | None = None  # None: running freely
        self._num_steps_done = 0
        llm.step = self._step

    def _step(self) -> list[Any]:
        with self._lock:
            if self._credits is not None:
                if self._credits == 0:
                    time.sleep(0.005)
                    return []
                self._credits -= 1
        try:
            return self._original()
        finally:
            with self._lock:
                self._num_steps_done += 1

    def pause(self) -> None:
        with self._lock:
            self._credits = 0

    def run(self, num_steps: int, timeout_s: float = 60) -> None:
        """While paused: let `num_steps` steps run and wait until they are done."""
        with self._lock:
            target = self._num_steps_done + num_steps
            self._credits = (self._credits or 0) + num_steps
        assert wait_for(lambda: self._num_steps_done >= target, timeout_s), "steps did not run"

    def resume(self) -> None:
        with self._lock:
            self._credits = None


class Harness:
    def __init__(self, url: str, app: Any) -> None:
        self.url = url
        self.engine = app.state.engine  # AsyncEngine
        self.llm = self.engine.engine  # LLMEngine, owned by the engine thread: read only
        self.gate = StepGate(self.llm)

    def metric(self, name: str) -> float:
        return read_metrics(self.url)[name]

    def engine_request(self, request_id: str) -> Any:
        return self.llm.scheduler.requests.get(request_id)

    def assert_pool_idle(self, timeout_s: float = 30) -> None:
        pool = self.llm.block_manager.pool
        idle = wait_for(
            lambda: (
                pool.num_free_blocks == NUM_BLOCKS
                and not self.llm.has_unfinished_requests()
                and not self.engine._streams
            ),
            timeout_s,
        )
        assert idle, (pool.num_free_blocks, self.llm.scheduler.requests, self.engine._streams)
        assert self.metric("pagedserve:num_free_blocks") == NUM_BLOCKS


def wait_for(condition: Callable[[], bool], timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    config = load_engine_config(
        cli={
            "num_kv_blocks": NUM_BLOCKS,
            "block_size": BLOCK_SIZE,
            "max_model_len": 128,
            "max_num_batched_tokens": 16,
            "max_num_seqs": 8,
            "log_level": "warning",
        },
        environ={},
    )
    app = create_app(config)
    port = free_port()
    server = GracefulServer(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
        ),
        grace_s=0.5,
    )
    thread = threading.Thread(target=server.run, name="reliability-uvicorn", daemon=True)
    thread.start()
    assert wait_for(lambda: server.started or not thread.is_alive(), STARTUP_TIMEOUT_S)
    assert server.started, "the in-process server did not start"
    harness = Harness(f"http://127.0.0.1:{port}", app)
    yield harness
    harness.gate.resume()
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def h(harness: Harness) -> Iterator[Harness]:
    """The harness, running freely and idle before and after each test."""
    harness.gate.resume()
    harness.assert_pool_idle()
    yield harness
    harness.gate.resume()
    harness.assert_pool_idle()


def open_raw_request(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a request on a raw socket and return it unread: closing it is a disconnect at any
    point, even before the response headers (which only come with the first token)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def complete(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", json={"temperature": 0, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def abort_at(
    h: Harness, phase_reached: Callable[[Any], bool], num_steps_each: int, body: dict[str, Any]
) -> Any:
    """Pause the engine, send `body`, run `num_steps_each` steps at a time until its engine
    request satisfies `phase_reached`, then disconnect while paused; return the request as it was
    when aborted (the engine thread is paused, so it cannot move on)."""
    aborted_before = h.metric("pagedserve:request_aborted_total")
    h.gate.pause()
    sock = open_raw_request(h.url, "/v1/completions", body)
    request_id = _wait_engine_request(h)
    try:
        deadline = time.monotonic() + 60
        while not phase_reached(h.engine_request(request_id)):
            assert time.monotonic() < deadline, "the request never reached the phase"
            h.gate.run(num_steps_each)
        request = h.engine_request(request_id)
        snapshot = (request.status, request.num_computed_tokens, request.num_output_tokens)
    finally:
        sock.close()
    assert wait_for(lambda: h.engine_request(request_id) is None), "the abort never landed"
    assert request.status == RequestStatus.FINISHED_ABORTED
    h.gate.resume()
    h.assert_pool_idle()
    assert wait_for(lambda: h.metric("pagedserve:request_aborted_total") == aborted_before + 1)
    return snapshot


def _wait_engine_request(h: Harness) -> str:
    """The id of the engine request that is in the scheduler now (exactly one is expected)."""
    assert wait_for(lambda: len(h.llm.scheduler.requests) == 1), "the request never arrived"
    (request_id,) = list(h.llm.scheduler.requests)
    return str(request_id)


def test_request_aborted_while_waiting_frees_everything_and_the_server_serves_on(h):
    status, num_computed, _ = abort_at(
        h,
        lambda request: request is not None,
        0,
        {"prompt": "Hello there", "max_tokens": 8, "stream": True},
    )
    assert status == RequestStatus.WAITING and num_computed == 0
    assert_completion(complete(h.url, prompt="Hello", max_tokens=2))


def test_request_aborted_while_prefilling_frees_its_partial_blocks(h):
    def mid_prefill(request: Any) -> bool:
        return request is not None and 0 < request.num_computed_tokens < request.num_prompt_tokens

    status, num_computed, num_output = abort_at(
        h, mid_prefill, 1, {"prompt": PROMPT_60_TOKENS, "max_tokens": 4, "stream": True}
    )
    assert status == RequestStatus.RUNNING and num_computed > 0 and num_output == 0
    assert_completion(complete(h.url, prompt="Hello", max_tokens=2))


def test_request_aborted_while_decoding_frees_its_blocks(h):
    def decoding(request: Any) -> bool:
        return request is not None and request.num_output_tokens >= 2

    status, _, num_output = abort_at(
        h,
        decoding,
        1,
        {"prompt": "Count: one two", "max_tokens": 40, "stream": True, "ignore_eos": True},
    )
    assert status == RequestStatus.RUNNING and num_output >= 2
    assert_completion(complete(h.url, prompt="Hello", max_tokens=2))


def test_client_disconnecting_mid_stream_aborts_and_others_complete(h):
    aborted_before = h.metric("pagedserve:request_aborted_total")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bystander = pool.submit(complete, h.url, prompt="The capital of France is", max_tokens=6)
        body = {"prompt": "Once upon a time", "max_tokens": 40, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{h.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            events = [next(lines) for _ in range(4)]  # two events, each followed by a blank line
        assert all(line.startswith("data: ") for line in events[::2]), events
        result = bystander.result(timeout=120)
    assert_completion(result)
    assert result["choices"][0]["finish_reason"] == "length"
    assert "Paris" in result["choices"][0]["text"]
    h.assert_pool_idle()
    assert wait_for(lambda: h.metric("pagedserve:request_aborted_total") == aborted_before + 1)


def test_a_sampling_error_fails_only_its_request(h, monkeypatch):
    prompts = ("The capital of France is", "1, 2, 3, 4,")
    reference = [
        complete(h.url, prompt=prompt, max_tokens=4)["choices"][0]["text"] for prompt in prompts
    ]
    sampler = h.llm.sampler
    original = sampler._sample_row

    def failing_sample_row(logits: Any, row: Any) -> Any:
        if row.params.seed == SENTINEL_SEED and len(row.output_token_ids) >= 2:
            raise RuntimeError("injected sampling fault")
        return original(logits, row)

    monkeypatch.setattr(sampler, "_sample_row", failing_sample_row)
    errors_before = h.metric(
        'pagedserve:request_success_total{finished_reason="error",'
        'model_name="SmolLM2-135M-Instruct"}'
    )
    faulty = {
        "prompt": "Tell me a story",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": SENTINEL_SEED,
        "ignore_eos": True,
    }
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        normal = [pool.submit(complete, h.url, prompt=prompt, max_tokens=4) for prompt in prompts]
        failed_plain = pool.submit(_failed_completion, h.url, faulty)
        failed_stream = pool.submit(_stream_completion, h.url, {**faulty, "stream": True})
        results = [future.result(timeout=180) for future in normal]
        plain, (events, done) = failed_plain.result(timeout=180), failed_stream.result(timeout=180)
    for result, expected_text in zip(results, reference, strict=True):
        assert_completion(result)
        assert result["choices"][0]["text"] == expected_text
    # The failed request is an error with the engine's reason, not a 200 with cut-off text:
    # a 500, or (its first tokens already streamed) an error event before [DONE].
    assert "failed in the engine: internal error: RuntimeError" in plain["message"], plain
    assert "injected" not in plain["message"]  # the exception's text stays in the server log
    assert done and events[-1]["error"] == plain, events[-3:]
    assert all(event["choices"][0]["finish_reason"] is None for event in events[:-1]), events
    assert (
        h.metric(
            'pagedserve:request_success_total{finished_reason="error",'
            'model_name="SmolLM2-135M-Instruct"}'
        )
        == errors_before + 2
    )
    h.assert_pool_idle()


def test_a_bug_while_adding_a_request_fails_only_that_request_with_a_500(h, monkeypatch):
    original = h.llm.add_validated_request  # what the engine thread runs for an "add"

    def failing_add_validated_request(request: Any) -> None:
        if request.params.seed == SENTINEL_SEED:
            raise KeyError("injected add fault")
        original(request)

    monkeypatch.setattr(h.llm, "add_validated_request", failing_add_validated_request)
    response = httpx.post(
        f"{h.url}/v1/completions",
        timeout=60,
        json={
            "model": "SmolLM2-135M-Instruct",
            "prompt": "Hello",
            "max_tokens": 2,
            "seed": SENTINEL_SEED,
        },
    )
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert "could not accept the request (KeyError)" in error["message"]
    assert "injected" not in error["message"]  # the exception's text stays in the server log
    assert_completion(complete(h.url, prompt="Hello", max_tokens=2))
    h.assert_pool_idle()


def test_a_failing_forward_pass_fails_its_batch_and_the_engine_serves_on(h, monkeypatch):
    runner = h.llm.runner
    original, calls = runner.execute, []

    def execute_failing_once(plan: Any, *embed: Any) -> Any:
        calls.append(plan)
        if len(calls) == 2:  # a decode step of the request below
            raise RuntimeError("injected forward fault")
        return original(plan, *embed)

    monkeypatch.setattr(runner, "execute", execute_failing_once)
    error = _failed_completion(h.url, {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
    assert "failed in the engine: internal error: RuntimeError" in error["message"], error
    monkeypatch.undo()
    assert h.engine.is_alive
    assert httpx.get(f"{h.url}/health", timeout=5).status_code == 200
    h.assert_pool_idle()
    assert_completion(complete(h.url, prompt="Hello", max_tokens=2))


def test_an_oversubscribed_pool_preempts_and_completes_every_request(h):
    preemptions_before = h.metric("pagedserve:num_preemptions_total")
    prompts = ["The quick brown fox jumps over the", "In the beginning there was"]
    bodies = [
        {"prompt": prompt, "max_tokens": 12, "ignore_eos": True} for prompt in prompts * 2
    ]  # 4 x 4-5 blocks against a pool of 16
    # Held at the gate until all four are in the scheduler: arriving one by one, a request could
    # finish before the last one starts and nothing would need preempting.
    h.gate.pause()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(complete, h.url, **body) for body in bodies]
        arrived = wait_for(lambda: len(h.llm.scheduler.requests) == len(bodies))
        h.gate.resume()
        assert arrived, "the requests never all reached the scheduler"
        results = [future.result() for future in futures]
    for result in results:
        assert_completion(result)
        assert result["usage"]["completion_tokens"] == 12
    texts = [result["choices"][0]["text"] for result in results]
    assert (
        texts[0::2] == [texts[0]] * 2 and texts[1::2] == [texts[1]] * 2
    )  # greedy, preempted or not
    assert h.metric("pagedserve:num_preemptions_total") > preemptions_before
    h.assert_pool_idle()


def test_a_request_larger_than_the_whole_pool_is_rejected_up_front(h):
    response = httpx.post(
        f"{h.url}/v1/completions", timeout=30, json={"prompt": PROMPT_60_TOKENS, "max_tokens": 60}
    )
    assert_openai_error(response.status_code, response.text, {400})


def _failed_completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error body of a completion that must fail in the engine with a 500."""
    response = httpx.post(f"{url}/v1/completions", json={"temperature": 0, **body}, timeout=120)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error", error
    return dict(error)


def _stream_completion(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as response:
        assert response.status_code == 200
        return parse_sse(list(response.iter_lines()))
