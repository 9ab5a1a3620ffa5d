"""Async stream plumbing: merge several engine streams, stop one when the client disconnects or the
server shuts down, and send Server-Sent Events.

Disconnects are detected by awaiting the ASGI `http.disconnect` message on `receive` (one listener
per request), never by polling, so an abort reaches the engine within one step even while the
request is still queued and produces nothing to send.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagedserve.server.errors import ClientDisconnectedError, ServerShuttingDownError, to_api_error
from pagedserve.server.protocol import SamplingFields, StreamOptions

T = TypeVar("T")
_DONE = object()


async def _close(stream: AsyncIterator[Any]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def _stop(task: asyncio.Future[Any]) -> None:
    """Cancel a task and wait until it has finished (without raising its outcome)."""
    task.cancel()
    await asyncio.wait({task})


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield `(stream_index, item)` from all streams as items arrive; the first error is raised.

    Every stream is iterated by its own task from the start, so all of them are queued in the
    engine at once. Closing the merged stream cancels those tasks, which closes every stream.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:  # handed over to the consumer, who raises it
            queue.put_nowait(exc)
        else:
            queue.put_nowait(_DONE)

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            entry = await queue.get()
            if entry is _DONE:
                num_running -= 1
            elif isinstance(entry, Exception):
                raise entry
            else:
                yield entry
    finally:
        for task in tasks:
            await _stop(task)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_stopped(
    stream: AsyncIterator[T],
    receive: Receive,
    shutdown: asyncio.Event,
    on_stop: Callable[[], Awaitable[None]],
) -> AsyncIterator[T]:
    """Yield from `stream` until the client sends `http.disconnect` (ClientDisconnectedError) or
    `shutdown` is set (ServerShuttingDownError); either way close `stream` and await `on_stop()`
    before raising. Call only after the request body has been read."""
    stops = {
        asyncio.ensure_future(_wait_for_disconnect(receive)): ClientDisconnectedError,
        asyncio.ensure_future(shutdown.wait()): ServerShuttingDownError,
    }
    next_item: asyncio.Future[T] | None = None
    try:
        while True:
            next_item = asyncio.ensure_future(anext(stream))  # type: ignore[arg-type]
            await asyncio.wait({next_item, *stops}, return_when=asyncio.FIRST_COMPLETED)
            if not next_item.done():
                await _stop(next_item)
                await _close(stream)
                await on_stop()
                raise next(error for stop, error in stops.items() if stop.done())()
            try:
                item = next_item.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if next_item is not None and not next_item.done():
            await _stop(next_item)  # we were cancelled mid-wait
        for stop in stops:
            await _stop(stop)
        await _close(stream)


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first`, then the items of `rest` (closing `rest` when this stream is closed)."""
    async with aclosing(rest):  # type: ignore[type-var]
        yield first
        async for item in rest:
            yield item


def sse_event(payload: Any) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame JSON chunks as SSE and end with `[DONE]`. After the first byte an error can no longer
    change the status code, so it is sent as an error event (OpenAI's error body), then `[DONE]`."""
    try:
        async with aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                yield sse_event(chunk)
    except ClientDisconnectedError:
        return  # nobody is listening any more
    except Exception as exc:
        yield sse_event(to_api_error(exc).body())
    yield SSE_DONE


class EventStreamResponse(Response):
    """Sends SSE events as they come. Unlike Starlette's StreamingResponse it never calls
    `receive`, so the event source's own disconnect listener is the only one."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async with aclosing(self.events):  # type: ignore[type-var]
            async for event in self.events:
                await send(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def force_usage(body: SamplingFields, request: Request) -> None:
    """--enable-force-include-usage (vLLM's): every stream carries usage, on each chunk and in a
    last chunk of its own, whatever its stream_options asked."""
    if request.app.state.config.server.enable_force_include_usage and body.stream:
        body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
