"""POST /v1/responses: OpenAI's Responses API (as vLLM serves it), answered by the chat route
(server/responses.py translates both ways). Streamed, it sends OpenAI's typed events
(`event: <type>` then its JSON), from `response.created` to `response.completed` (or
`response.incomplete`, or `response.failed` if the engine fails the request after the stream
began); whole, the response object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.server.background_responses import detached
from pagedserve.server.errors import (
    APIError,
    ClientDisconnectedError,
    invalid_request,
    to_api_error,
)
from pagedserve.server.input_items import DEFAULT_LIMIT, MAX_LIMIT, input_items, page
from pagedserve.server.request_fields import check_request_fields
from pagedserve.server.response_store import (
    ResponseStore,
    StoredResponse,
    UnknownResponseError,
    encode,
)
from pagedserve.server.responses import (
    FAILURE_CODES,
    RESPONSES_PARAM,
    ResponseBuilder,
    in_responses_terms,
    input_messages,
    output_messages,
    response_events,
    to_chat_request,
)
from pagedserve.server.responses_protocol import INCLUDABLE, ResponseObject, ResponsesRequest
from pagedserve.server.routes.chat import start_chat
from pagedserve.server.streams import EventStreamResponse

router = APIRouter()


@router.post("/v1/responses", response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    check_request_fields(body, request.state.request_id)
    store: ResponseStore = request.app.state.response_store
    if body.background and not (body.store and store.enabled):  # as OpenAI: it must be polled
        raise invalid_request(
            "background needs store (and a server that stores responses: "
            "--responses-store-memory above 0).",
            "background",
        )
    history = _history(body, store)
    turn = input_messages(body)
    # Before the engine starts: what cannot be listed is a 400, not a request left running
    items = _encoded_input_items(body)
    source = detached(request) if body.background else request
    try:
        run = await start_chat(to_chat_request(body, history, turn), source)
    except APIError as error:  # named as this API names the parameter
        error.param = RESPONSES_PARAM.get(error.param or "", error.param)
        error.message = in_responses_terms(error.message)
        raise
    response = _response(body, request, run.header["model"])
    response.store = body.store and store.enabled
    keep = _keeper(store, turn, items) if response.store else None
    builder = ResponseBuilder(response, keep)
    events = response_events(builder, run.chunks())
    if body.background:
        assert keep is not None  # background needs the store: checked above
        request.app.state.background_responses.start(builder, events, keep)
        return JSONResponse(builder.response.model_dump())
    if body.stream:
        return EventStreamResponse(_sse(builder, events))
    async with aclosing(events):
        async for _ in events:
            pass
    return JSONResponse(builder.response.model_dump())


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(response_id: str, request: Request) -> Response:
    stored = _stored(request, response_id)
    return Response(stored.response_json, media_type="application/json")


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    before: str | None = None,
    include: Annotated[list[str] | None, Query()] = None,
    include_brackets: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> dict[str, Any]:
    """A stored response's input items, a page at a time (server/input_items.py). `include`
    (`include[]` as the openai SDK sends it) is checked; the items are listed as they were sent."""
    for value in [*(include or []), *(include_brackets or [])]:
        if value not in INCLUDABLE:
            raise invalid_request(f"include: {value!r} is not one of OpenAI's values.", "include")
    items = json.loads(_stored(request, response_id).input_items_json)
    return page(items, limit=limit, order=order, after=after, before=before)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    _stored(request, response_id)
    await request.app.state.background_responses.cancel(response_id)  # a running one stops
    request.app.state.response_store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject)
async def cancel_response(response_id: str, request: Request) -> Response:
    """Stop a background response (OpenAI's): the response as it stands, `cancelled`; one that
    already ended is returned as it ended."""
    background = request.app.state.background_responses
    if background.is_running(response_id):
        await background.cancel(response_id)  # stored cancelled, even if the store had forgotten
    elif not json.loads(_stored(request, response_id).response_json).get("background"):
        raise invalid_request("Only background responses can be cancelled.", "response_id")
    return Response(_stored(request, response_id).response_json, media_type="application/json")


def _stored(request: Request, response_id: str) -> StoredResponse:
    try:
        return request.app.state.response_store.get(response_id)
    except UnknownResponseError:
        raise APIError(
            404, f"Response with id '{response_id}' not found.", param="response_id"
        ) from None


def _encoded_input_items(body: ResponsesRequest) -> bytes:
    """The request's input items (server/input_items.py) as the store keeps them."""
    try:
        return encode(input_items(body))
    except UnicodeEncodeError:  # a lone surrogate (\ud800) in a field only the items carry
        raise invalid_request("input holds a string that is not valid Unicode.", "input") from None


def _keeper(
    store: ResponseStore, turn: list[dict[str, Any]], items_json: bytes
) -> Callable[[ResponseObject], bool]:
    """Stores the response as it stands: a finished one as answered (one that failed or whose
    client went away never gets here), a background one at each change of its status; store
    true, unless it alone is larger than the store. `items_json`: its input as OpenAI lists it."""

    def keep(response: ResponseObject) -> bool:
        messages = encode([*turn, *output_messages(response)])
        entry = StoredResponse(
            encode(response.model_dump()), response.previous_response_id, messages, items_json
        )
        return store.put(response.id, entry)

    return keep


def _history(body: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The earlier turns' messages that `previous_response_id` continues (none without it)."""
    previous = body.previous_response_id
    if previous is None:
        return []
    if not store.enabled:
        raise invalid_request(
            "previous_response_id: this server stores no responses (--responses-store-memory "
            "0); send the whole conversation as input.",
            "previous_response_id",
        )
    try:
        return store.conversation(previous)
    except UnknownResponseError as error:
        which = "Previous response" if error.response_id == previous else "A response it continues"
        raise APIError(
            404, f"{which} with id '{error.response_id}' not found.", param="previous_response_id"
        ) from None


def _response(body: ResponsesRequest, request: Request, model: str) -> ResponseObject:
    """The response object before any output: the request's settings, as OpenAI echoes them."""
    defaults = request.app.state.engine.sampling_defaults
    return ResponseObject(
        id=f"resp_{request.state.request_id}",
        created_at=request.state.created,
        status="in_progress",
        model=model,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=_first(body.temperature, defaults.get("temperature"), 1.0),
        top_p=_first(body.top_p, defaults.get("top_p"), 1.0),
        top_logprobs=body.top_logprobs,
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        parallel_tool_calls=body.parallel_tool_calls,
        text=_text_config(body),
        reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        truncation=body.truncation,
        previous_response_id=body.previous_response_id,
        background=body.background,
        metadata=body.metadata or {},
        user=body.user,
    )


def _text_config(body: ResponsesRequest) -> dict[str, Any]:
    given = body.text.model_dump(exclude_none=True, by_alias=True) if body.text else {}
    return {"format": {"type": "text"}} | given


def _first(*values: Any) -> Any:
    return next(value for value in values if value is not None)


async def _sse(
    builder: ResponseBuilder, events: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[str]:
    """OpenAI's framing: each event's type on an `event:` line, then its JSON. A failure after
    the stream began ends it with `response.failed`, carrying the error."""
    try:
        async with aclosing(events):
            async for event in events:
                yield _frame(event)
    except ClientDisconnectedError:
        return  # nobody is listening any more
    except Exception as exc:
        error = to_api_error(exc)
        code = FAILURE_CODES.get(error.status_code, "server_error")
        yield _frame(builder.fail(code, error.message))


def _frame(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
