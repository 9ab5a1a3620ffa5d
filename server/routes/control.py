"""Operating the engine over HTTP: forgetting the prefix cache (SGLang's `/flush_cache`, which
sglang-router fans out to its workers, and vLLM's `/reset_prefix_cache`), and aborting requests
by id (SGLang's `/abort_request`).

The prefix cache is reset only while no request is queued or running (as both servers do): a
running request's blocks may be shared, and a benchmark that flushes between runs wants the next
run to start cold, not a half-flushed cache.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from pagedserve.server.errors import APIError, invalid_request
from pagedserve.server.protocol import _Request

router = APIRouter()
MAX_FLUSH_WAIT_S = 600.0
_POLL_S = 0.05


def _busy() -> APIError:
    return APIError(
        400,
        "The prefix cache was not reset: requests are queued or running (it is reset only "
        "while the engine is idle).",
        "invalid_request_error",
    )


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(
    request: Request, timeout: float = Query(0.0, ge=0.0, le=MAX_FLUSH_WAIT_S)
) -> Response:
    """SGLang's: 200 "Cache flushed." once reset; waits up to `timeout` seconds for the engine
    to become idle, else a 400."""
    engine = request.app.state.engine
    deadline = time.monotonic() + timeout
    while not await engine.reset_prefix_cache():
        if time.monotonic() >= deadline:
            raise _busy()
        await asyncio.sleep(_POLL_S)
    return PlainTextResponse("Cache flushed.\n")


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    request: Request,
    reset_running_requests: bool = False,
    reset_external: bool = False,  # no external (connector) cache here: nothing more to reset
) -> Response:
    """vLLM's: 200 with an empty body once reset; a 400 while requests are in flight (vLLM logs
    a warning and answers 200)."""
    if reset_running_requests:
        raise invalid_request(
            "reset_running_requests is not supported: the cache is reset only while the engine "
            "is idle.",
            "reset_running_requests",
        )
    if not await request.app.state.engine.reset_prefix_cache():
        raise _busy()
    return Response(status_code=200)


class AbortRequest(_Request):
    rid: str = Field("", max_length=1024)
    abort_all: bool = False


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> Response:
    """SGLang's: abort the request `rid` (a /generate rid; a batch's rid aborts its `<rid>_<i>`
    prompts; an OpenAI request's `x-request-id` aborts its prompts), or every request with
    `abort_all`. 200 with an empty body, also for an id no longer in flight (it finished). The
    aborted requests end as they would on a client's disconnect: finish reason "abort", with what
    they had produced."""
    if not body.rid and not body.abort_all:
        raise invalid_request("Give the rid of the request to abort, or abort_all.", "rid")
    in_flight = request.app.state.engine_requests
    targets = [
        request_id
        for request_id in list(in_flight)
        if body.abort_all
        or request_id == body.rid
        or request_id.startswith((f"{body.rid}_", f"{body.rid}-"))
    ]
    for request_id in targets:
        await request.app.state.engine.abort(request_id)
    return Response(status_code=200)
