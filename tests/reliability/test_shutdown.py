"""Graceful shutdown on SIGTERM: the server stops accepting connections, ends every in-flight
request with a final event (a stream: an error event then `[DONE]`; a plain request: a 503 error
body, unless it finished in the grace period), and exits 0 within a timeout.

It takes over the suite's shared server (started with `--timeout-graceful-shutdown 3`)."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx

from tests.reliability.support import AUTH, assert_openai_error, parse_sse, read_metrics

EXIT_TIMEOUT_S = 30.0
LONG = {
    "prompt": "Write a very long story about a dragon.",
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 0,
}


def _plain_request(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=LONG, headers=AUTH, timeout=60)


def _wait_until_in_engine(url: str, num_requests: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = read_metrics(url)
        if (
            samples["pagedserve:num_requests_running"] + samples["pagedserve:num_requests_waiting"]
        ) >= num_requests:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {num_requests} requests reached the engine")


def test_sigterm_stops_accepting_ends_open_requests_with_a_final_event_and_exits_zero(
    shared_server,
):
    server = shared_server.take()
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={**LONG, "stream": True},
            headers=AUTH,
            timeout=60,
        ) as stream,
    ):
        plain = pool.submit(_plain_request, server.url)
        lines = stream.iter_lines()
        first = next(lines)
        assert first.startswith("data: "), first
        _wait_until_in_engine(server.url, num_requests=2)  # the plain request reached it too
        sent_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        refused = False
        deadline = time.monotonic() + 2.5  # inside the 3 s grace: the requests are still open
        while time.monotonic() < deadline and not refused:
            try:
                httpx.get(f"{server.url}/health", timeout=1)
            except httpx.TransportError:
                refused = True
            time.sleep(0.1)
        rest = [line for line in lines if line]
        plain_response = plain.result(timeout=EXIT_TIMEOUT_S)

    assert refused, "the server still accepted connections after SIGTERM"
    events, done = parse_sse([first, *rest])
    assert done, rest[-3:]
    final = events[-1]
    assert "error" in final and final["error"]["code"] == "shutting_down", final
    assert_openai_error(plain_response.status_code, plain_response.text, {503})
    assert plain_response.json()["error"]["code"] == "shutting_down"

    returncode = server.process.wait(timeout=EXIT_TIMEOUT_S)
    exit_s = time.monotonic() - sent_at
    print(f"\nFIGURE SIGTERM to exit: {exit_s:.1f} s (exit status {returncode})")
    assert returncode == 0, server.log_tail()
    assert exit_s < EXIT_TIMEOUT_S
