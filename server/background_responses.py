"""Background responses (OpenAI's `background: true`): POST /v1/responses answers with the
response `queued` once the request is accepted (validated, queued, its first token out, as a
stream's first event waits for it), the generation runs on as a task of its own, detached from
the request that started it (a client may leave and poll), and GET /v1/responses/{id} shows it
as stored: `queued`, `in_progress`, then `completed`, `incomplete`, `failed` or `cancelled`.
POST /v1/responses/{id}/cancel (or DELETE, or /abort_request on its engine request) stops it,
as on a client's disconnect. Server shutdown cancels the running ones, before the engine stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request

from pagedserve.server.errors import to_api_error
from pagedserve.server.responses import FAILURE_CODES, ResponseBuilder
from pagedserve.server.responses_protocol import ResponseObject

logger = logging.getLogger(__name__)
CANCEL_WAIT_S = 10.0  # a cancelled run stops within a step; this is a backstop


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()  # a background run outlives the request that started it
    return {"type": "http.disconnect"}


def detached(request: Request) -> Request:
    """`request` as a generation sees it, without its client: no disconnect ever arrives."""
    return Request(request.scope, _never_disconnects)


class BackgroundResponses:
    """The running background responses, by id (the tasks are kept here, or they could be
    collected mid-run)."""

    def __init__(self) -> None:
        self._runs: dict[str, asyncio.Task[None]] = {}

    def start(
        self,
        builder: ResponseBuilder,
        events: AsyncIterator[dict[str, Any]],
        keep: Callable[[ResponseObject], bool],
    ) -> None:
        """Store the response `queued` and run it to its end in a task of its own."""
        builder.response.status = "queued"
        keep(builder.response)
        response_id = builder.response.id
        task = asyncio.get_running_loop().create_task(_run(builder, events, keep))
        self._runs[response_id] = task
        task.add_done_callback(lambda _: self._runs.pop(response_id, None))

    def is_running(self, response_id: str) -> bool:
        """Whether it still runs (then it is cancellable even if the store forgot it)."""
        return response_id in self._runs

    async def stop_all(self) -> None:
        """At shutdown, after the engine's: what still runs is cancelled, not left pending."""
        for response_id in list(self._runs):
            await self.cancel(response_id)

    async def cancel(self, response_id: str) -> None:
        """Stop a running one (stored as `cancelled`); nothing if none runs by that id."""
        task = self._runs.get(response_id)
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)


async def _run(
    builder: ResponseBuilder,
    events: AsyncIterator[dict[str, Any]],
    keep: Callable[[ResponseObject], bool],
) -> None:
    response = builder.response
    try:
        async with aclosing(events):
            async for event in events:
                if event["type"] == "response.in_progress":
                    response.status = "in_progress"
                    keep(response)
        if builder.aborted:  # /abort_request: what it had written, cancelled
            response.status, response.incomplete_details = "cancelled", None
            keep(response)
        # else builder.finish() stored it, completed or incomplete
    except asyncio.CancelledError:
        # Only `cancel` cancels this task, and it awaits the task's end: nothing above it
        # needs the cancellation to propagate, and the stored status is the point.
        response.status = "cancelled"
        keep(response)
    except Exception as exc:  # noqa: BLE001 - the run's failure is its stored status
        error = to_api_error(exc)
        if error.status_code >= 500:
            logger.warning("background response %s failed: %s", response.id, error.message)
        builder.fail(FAILURE_CODES.get(error.status_code, "server_error"), error.message)
        keep(response)
