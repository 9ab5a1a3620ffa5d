"""Operating the engine over HTTP: forgetting the prefix cache (SGLang's `/flush_cache`, which
sglang-router fans out to its workers, and vLLM's `/reset_prefix_cache`), and aborting requests
by id (SGLang's `/abort_request`).

The prefix cache is reset only while no request is queued or running (as both servers do): a
running request's blocks may be shared, and a benchmark that flushes between runs wants the next
run to start cold, not a half-flushed cache.
"""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from pagedserve.server.errors import APIError, invalid_request
from pagedserve.server.protocol import _Request

router = APIRouter()
_HEX_ID = re.compile(r"[0-9a-f]{32}")  # the server's own request ids (x-request-id)
MAX_FLUSH_WAIT_S = 600.0
_POLL_S = 0.05


def _busy() -> APIError:
    return APIError(
        400,
        "The prefix cache was not reset: requests are queued or running (it is reset only "
        "while the engine is idle).",
        "invalid_request_error",
    )


# Two decorators, not api_route(methods=[...]): that would give both methods one OpenAPI id.
@router.get("/flush_cache")
@router.post("/flush_cache")
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


def _names(rid: str, request_id: str) -> bool:
    """Whether `rid` names the engine request `request_id`: its own id; a /generate batch's rid
    (its prompts are `<rid>_<i>`); one choice of n (`<id>_<j>`: aborting it aborts the request,
    whose choices the engine runs together); or an OpenAI request's `x-request-id` (a 32-digit
    hex id whose prompts are `<id>-<i>`)."""
    return (
        request_id == rid
        or _numbered(request_id, f"{rid}_")
        or _numbered(rid, f"{request_id}_")
        or (_HEX_ID.fullmatch(rid) is not None and _numbered(request_id, f"{rid}-"))
    )


def _numbered(name: str, prefix: str) -> bool:
    """`name` is `prefix` and a number (so `job` does not name `job_extra`)."""
    suffix = name[len(prefix) :]
    return name.startswith(prefix) and suffix.isascii() and suffix.isdigit()


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> Response:
    """SGLang's: abort the requests `rid` names (`_names`), or every request with `abort_all`.
    200 with an empty body, also for an id no longer in flight (it finished). The aborted requests
    end as they would on a client's disconnect: finish reason "abort", with what they had made."""
    if not body.rid and not body.abort_all:
        raise invalid_request("Give the rid of the request to abort, or abort_all.", "rid")
    targets = [
        request_id
        for request_id in list(request.app.state.engine_requests)
        if body.abort_all or _names(body.rid, request_id)
    ]
    for request_id in targets:
        await request.app.state.engine.abort(request_id)
    return Response(status_code=200)
