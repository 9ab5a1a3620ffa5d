"""GET /v1/responses/{id}/input_items (OpenAI's): the items a stored response was asked with, a
page at a time.

A response keeps its request's `input` as OpenAI lists it: every item with an id (the one the
client sent on it, else one made when the response was created, so every listing agrees), a
string input as one user message, a message's string content as one text part (`input_text`,
`output_text` for an assistant's), calls and their outputs `completed`. Only the response's own
input is listed, not the turns of the responses it continues (`previous_response_id`), which
keep their own.
"""

from __future__ import annotations

import uuid
from typing import Any

from pagedserve.server.errors import invalid_request
from pagedserve.server.responses_protocol import ContentPart, InputItem, ResponsesRequest

# OpenAI's id prefixes, by item type
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as OpenAI's input items (already checked by `input_messages`)."""
    if isinstance(body.input, str):
        return [_message("user", body.input, None)]
    return [_item(item) for item in body.input]


def _item(item: InputItem) -> dict[str, Any]:
    if item.type == "message":
        return _message(item.role or "user", item.content or "", item.id)
    fields = item.model_dump(exclude_none=True, exclude={"id", "role", "content"})
    if isinstance(item.output, list):  # parts as sent, without the fields they left out
        fields["output"] = [_part(part) for part in item.output]
    status = {"status": "completed"} if item.type in ID_PREFIXES else {}  # reasoning has none
    return {"id": item.id or _new_id(item.type), **fields, **status}


def _message(role: str, content: str | list[ContentPart], item_id: str | None) -> dict[str, Any]:
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    else:
        parts = [_part(part) for part in content]
    return {
        "id": item_id or _new_id("message"),
        "type": "message",
        "role": role,
        "content": parts,
        "status": "completed",
    }


def _part(part: ContentPart) -> dict[str, Any]:
    return part.model_dump(exclude_none=True)


def _new_id(item_type: str) -> str:
    return f"{ID_PREFIXES.get(item_type, 'item')}_{uuid.uuid4().hex}"


def page(
    items: list[dict[str, Any]],
    *,
    limit: int,
    order: str,
    after: str | None,
    before: str | None,
) -> dict[str, Any]:
    """OpenAI's list object: up to `limit` items in `order` ("desc", the default there: the last
    item first), those after the item `after` and before the item `before` (ids; a 400 names an
    id the response's input does not hold)."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = _position(ids, after, "after") + 1 if after is not None else 0
    end = _position(ids, before, "before") if before is not None else len(ordered)
    data = ordered[start:end][:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + len(data) < end,
    }


def _position(ids: list[str], item_id: str, param: str) -> int:
    if item_id not in ids:
        raise invalid_request(f"No input item with id '{item_id}' in this response.", param)
    return ids.index(item_id)
