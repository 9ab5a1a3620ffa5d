"""A client that goes away aborts its engine requests: found by listening for `http.disconnect`."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.anyio


def _scope(path: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }


async def _call_then_disconnect(app, path: str, body: dict, disconnect: asyncio.Event) -> list:
    """Run one request over raw ASGI; `receive` reports a disconnect once `disconnect` is set."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            disconnect.set()  # the client leaves after its first event

    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(_scope(path), receive, send), timeout=5)
    return sent


async def test_disconnect_mid_stream_aborts_the_request(app, engine):
    engine.hang_after_first_delta = True
    sent = await _call_then_disconnect(
        app,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
        asyncio.Event(),
    )
    request_id = engine.requests[0][0]
    assert engine.aborted == [request_id] and engine.closed_early == [request_id]
    assert sent[0]["status"] == 200


async def test_disconnect_before_a_plain_response_aborts_the_request(app, engine):
    engine.hang_after_first_delta = True
    disconnect = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, disconnect.set)
    sent = await _call_then_disconnect(app, "/v1/completions", {"prompt": "hi"}, disconnect)
    assert engine.aborted == [engine.requests[0][0]]
    assert engine.closed_early == engine.aborted
    assert sent[0]["status"] == 499


async def test_disconnect_counts_as_an_abort_in_metrics(app, engine):
    from prometheus_client.parser import text_string_to_metric_families

    engine.hang_after_first_delta = True
    await _call_then_disconnect(
        app, "/v1/completions", {"prompt": "hi", "n": 2, "stream": True}, asyncio.Event()
    )
    samples = {
        (sample.name, sample.labels.get("finished_reason")): sample.value
        for family in text_string_to_metric_families(app.state.metrics.render().decode())
        for sample in family.samples
    }
    assert samples[("pagedserve:request_success_total", "abort")] == 2
    assert samples[("pagedserve:request_aborted_total", None)] == 2
