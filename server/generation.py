"""Run one HTTP request's prompts through the engine: one engine request per prompt, their deltas
merged, the client (and server shutdown) watched, every delta recorded (metrics, usage, log line).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from pagedserve.configs import SamplingParams, SamplingParamsError
from pagedserve.engine.client import EngineClient
from pagedserve.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from pagedserve.engine.outputs import RequestDelta
from pagedserve.server.beam_search import BeamSearchParams, beam_search
from pagedserve.server.errors import (
    APIError,
    ClientDisconnectedError,
    ServerShuttingDownError,
    invalid_request,
    to_api_error,
)
from pagedserve.server.recorder import RequestRecorder
from pagedserve.server.streams import merge_streams, prepend, until_stopped

logger = logging.getLogger(__name__)

Item = tuple[int, RequestDelta]  # (prompt index, delta)
# What the engine raises when it refuses a request before running any of it.
_REFUSALS = (InvalidRequestError, SamplingParamsError, EngineOverloadedError, EngineDeadError)


@dataclass(frozen=True, slots=True)
class EngineInput:
    token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    beam: BeamSearchParams | None = None  # use_beam_search: searched, not sampled


def engine_request_id(http_request_id: str, prompt_idx: int) -> str:
    """Each prompt of one HTTP request is its own engine request (README: "Ids")."""
    return f"{http_request_id}-{prompt_idx}"


async def _recorded(
    stream: AsyncIterator[Item], recorder: RequestRecorder, on_end: Callable[[], None]
) -> AsyncIterator[Item]:
    # "abort" also when the consumer stops early (its client went away); None: never accepted.
    unfinished_reason: str | None = "abort"
    accepted = False
    try:
        async for prompt_idx, delta in stream:
            accepted = True
            recorder.observe(prompt_idx, delta)
            if delta.finish_reason == "error":
                # A choice that failed in the engine fails the request, with the engine's reason
                # (as vLLM): a 500, or an error event once streaming, never a 200 whose cut-off
                # text a client would take for the answer. The engine has logged the cause.
                reason = delta.error or "no reason given"
                raise to_api_error(
                    RequestFailedError(f"The request failed in the engine: {reason}.")
                )
            yield prompt_idx, delta
    except (ClientDisconnectedError, ServerShuttingDownError):
        raise
    except Exception as exc:
        if not accepted and isinstance(exc, _REFUSALS):
            unfinished_reason = None  # 400/429/503 before anything ran: no finished request
            raise
        unfinished_reason = "error"
        if to_api_error(exc).status_code >= 500 and not isinstance(exc, APIError):
            logger.error("request %s failed", recorder.request_id, exc_info=exc)
        raise
    finally:
        on_end()
        recorder.close(unfinished_reason)


def _check_fits(inputs: list[EngineInput], max_in_flight: int) -> None:
    """A 400 for a request that needs more engine requests at once than the server ever runs
    (a beam search runs one per beam): a 429 would tell its client to retry forever."""
    needed = sum(item.beam.width if item.beam is not None else 1 for item in inputs)
    if needed > max_in_flight:
        raise invalid_request(
            f"This request needs {needed} engine requests at once ({len(inputs)} prompts, one per "
            f"beam with use_beam_search); the server runs at most {max_in_flight} "
            "(max_waiting_requests).",
            "n",
        )


async def start_generation(
    request: Request,
    inputs: list[EngineInput],
    recorder: RequestRecorder,
    engine_ids: list[str] | None = None,
) -> AsyncIterator[Item]:
    """Queue every prompt and wait for the first delta, so that engine errors raised before it
    (invalid, overloaded, dead) still become HTTP errors; then return the whole stream.
    `engine_ids`: each prompt's engine request id (default: the HTTP request's id and its index;
    SGLang's /generate names them by its `rid`)."""
    engine: EngineClient = request.app.state.engine
    _check_fits(inputs, engine.max_waiting_requests)
    ids = engine_ids or [engine_request_id(recorder.request_id, i) for i in range(len(inputs))]
    streams = [
        engine.generate(item.token_ids, item.params, request_id, item.priority)
        if item.beam is None
        else beam_search(engine, item.token_ids, item.beam, request_id, item.priority)
        for request_id, item in zip(ids, inputs, strict=True)
    ]

    async def abort_all() -> None:
        # Closing the iterators already aborts; an explicit abort also covers a request the
        # engine has accepted but whose iterator never got to run.
        for request_id in ids:
            await engine.abort(request_id)

    guarded = until_stopped(
        merge_streams(streams), request.receive, request.app.state.stop_requests, abort_all
    )
    # The engine requests in flight, by id, for /abort_request (server/routes/control.py)
    registry: set[str] = request.app.state.engine_requests
    sampled = [rid for rid, item in zip(ids, inputs, strict=True) if item.beam is None]
    registry.update(sampled)
    stream = _recorded(guarded, recorder, lambda: registry.difference_update(sampled))
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()
        raise
    return prepend(first, stream)
