"""GET /v1/responses/{id}/input_items (OpenAI's): the items a stored response was asked with, a
page at a time.

A response keeps its request's `input` as OpenAI lists it, in shapes the openai SDK's item types
read: every item with an id (the one the client sent on it, else one made when the response was
created, so every listing agrees; two items with one id are a 400 at creation, as OpenAI's), a
string input as one user message, a message's content as text parts of its side (`input_text`,
an assistant's `output_text` with its `annotations`; a refusal stays one), a function call's
output parts as `input_text`, calls and outputs `completed` unless the client said otherwise, a
reasoning item with its `summary`. Only the response's own input is listed, not the turns of the
responses it continues (`previous_response_id`), which keep their own.
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.errors import invalid_request
from pagedserve.server.responses import new_id
from pagedserve.server.responses_protocol import ContentPart, InputItem, ResponsesRequest

# OpenAI's id prefixes, by item type
ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}
WITH_STATUS = frozenset({"message", "function_call", "function_call_output"})
DEFAULT_LIMIT, MAX_LIMIT = 20, 100
MAX_ID_SHOWN = 80  # characters of a client's id an error message repeats


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as OpenAI's input items (already read by `input_messages`); a 400
    names an id that two items share."""
    if isinstance(body.input, str):
        return [_message("user", body.input, {})]
    items = [_item(item) for item in body.input]
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            raise invalid_request(
                f"Duplicate item found with id {_shown(item['id'])}. Remove duplicate items from "
                "your input and try again.",
                "input",
            )
        seen.add(item["id"])
    return items


def _item(item: InputItem) -> dict[str, Any]:
    if item.type == "message":
        extra = (item.model_extra or {}) | ({"id": item.id} if item.id else {})
        return _message(item.role or "user", item.content or "", extra)
    fields = item.model_dump(exclude_none=True, exclude={"id", "output"})
    if item.output is not None:
        fields["output"] = (
            _parts(item.output, "user") if isinstance(item.output, list) else item.output
        )
    if item.type == "reasoning":
        fields.setdefault("summary", [])
    status = {"status": "completed"} if item.type in WITH_STATUS else {}
    return {"id": item.id or _new_id(item.type)} | status | fields


def _message(role: str, content: str | list[ContentPart], extra: dict[str, Any]) -> dict[str, Any]:
    """A message item; `extra`: the client's own fields on it (its id, phase, status...)."""
    parts = _parts(
        [ContentPart(type="input_text", text=content)] if isinstance(content, str) else content,
        role,
    )
    return {
        "id": extra.get("id") or _new_id("message"),  # made only where the client sent none
        "type": "message",
        "role": role,
        "status": "completed",
        **extra,
        "content": parts,
    }


def _parts(parts: list[ContentPart], role: str) -> list[dict[str, Any]]:
    """Text parts as the side that wrote them: OpenAI's input items hold `input_text` parts, an
    assistant's `output_text` (with `annotations` and `logprobs`, which the SDK's type requires)
    or `refusal`."""
    listed = []
    for part in parts:
        fields = part.model_dump(exclude_none=True)
        if role == "assistant" and part.type == "refusal":
            listed.append(fields)
            continue
        text = part.text if part.text is not None else part.refusal or ""
        fields = {k: v for k, v in fields.items() if k not in ("type", "text", "refusal")}
        if role == "assistant":
            listed.append(
                {"type": "output_text", "text": text, "annotations": [], "logprobs": []} | fields
            )
        else:
            listed.append({"type": "input_text", "text": text} | fields)
    return listed


def _new_id(item_type: str) -> str:
    return new_id(ID_PREFIXES.get(item_type, "item"))


def _shown(item_id: str) -> str:
    return item_id if len(item_id) <= MAX_ID_SHOWN else item_id[:MAX_ID_SHOWN] + "..."


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
        raise invalid_request(f"No input item with id '{_shown(item_id)}' in this response.", param)
    return ids.index(item_id)
