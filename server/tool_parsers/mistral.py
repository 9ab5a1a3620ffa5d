"""Mistral's calls, after its `[TOOL_CALLS]` control token, in either of its conventions:

- tokenizers up to v7 (Mistral 7B Instruct v0.3, Mixtral 8x22B, Mistral Small 3.1): one JSON
  list, `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): `[TOOL_CALLS]f[ARGS]{...}` per call,
  `f[CALL_ID]id[ARGS]{...}` where the tokenizer has call ids (the server gives its own).

`[TOOL_CALLS]` and `[ARGS]` are special tokens, so the chat route keeps special tokens in the text
of requests this parser reads (`ToolPlan.shows_special_tokens`), as vLLM does. Text before the
first `[TOOL_CALLS]` streams as content; the calls after it come at the end, all or none (a
reply whose calls do not parse is returned as the text it was). Mistral's chat templates accept
only 9-character alphanumeric call ids, which the server then gives its calls (tools.py).
"""

from __future__ import annotations

import json

from pagedserve.server.json_input import load_json
from pagedserve.server.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    call_from_object,
    held_back,
    make_call,
    whole_calls,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralParser:
    """Streams text until the first `[TOOL_CALLS]`; everything from there is read at `finish`."""

    def __init__(self) -> None:
        self._pending = ""  # a possible tag start, or everything from the first tag on
        self._in_calls = False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._pending += text
        if self._in_calls:
            return "", []
        start = self._pending.find(TOOL_CALLS)
        if start >= 0:
            self._in_calls = True
            shown, self._pending = self._pending[:start], self._pending[start:]
            return shown, []
        keep = held_back(self._pending, TOOL_CALLS)
        shown = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(shown) :]
        return shown, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        text, self._pending = self._pending, ""
        if not self._in_calls:
            return text, []
        calls = parse_calls(text)
        return ("", whole_calls(calls)) if calls else (text, [])


def parse_calls(text: str) -> list[ParsedCall]:
    """The calls of `text` (from its first `[TOOL_CALLS]`), or [] if it is not all calls."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        return []
    rest = text[start + len(TOOL_CALLS) :].strip()
    if rest.startswith("["):  # the JSON list: all the rest (a tag inside a string is text)
        return _json_list(rest)
    calls = []
    while True:
        call, rest = _named_call(rest)
        if call is None:
            return []
        calls.append(call)
        if not rest:
            return calls
        if not rest.startswith(TOOL_CALLS):
            return []
        rest = rest[len(TOOL_CALLS) :].lstrip()


def _json_list(text: str) -> list[ParsedCall]:
    try:
        value = load_json(text)
    except ValueError:
        return []
    if not isinstance(value, list) or not value:
        return []
    calls = [call_from_object(item) for item in value]
    return calls if all(call is not None for call in calls) else []  # type: ignore[return-value]


def _named_call(text: str) -> tuple[ParsedCall | None, str]:
    """`name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`, v13 on: the id is left, the server
    gives its own) at the start of `text`: the call and the text after it, or (None, "")."""
    head, separator, arguments = text.partition(ARGS)
    name = head.partition(CALL_ID)[0].strip()
    if not separator or not name or any(c.isspace() or c in "[]" for c in name):
        return None, ""
    arguments = arguments.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(arguments)
    except (ValueError, RecursionError):
        return None, ""
    if not isinstance(value, dict):
        return None, ""
    return make_call(name, value), arguments[end:].strip()
