"""Mistral's calls, after its `[TOOL_CALLS]` control token, in either of its conventions:

- tokenizers up to v7 (Mistral 7B Instruct v0.3, Mixtral 8x22B, Mistral Small 3.1): one JSON
  list, `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): `[TOOL_CALLS]f[ARGS]{...}` per call.

`[TOOL_CALLS]` and `[ARGS]` are special tokens, so the chat route keeps special tokens in the text
of requests this parser reads (`ToolPlan.shows_special_tokens`), as vLLM does. Text before the
first `[TOOL_CALLS]` streams as content; the calls after it come at the end, all or none (a
reply whose calls do not parse is returned as the text it was). Mistral's chat templates accept
only 9-character alphanumeric call ids, which the server then gives its calls (tools.py).
"""

from __future__ import annotations

from pagedserve.server.json_input import load_json
from pagedserve.server.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    call_from_object,
    held_back,
    make_call,
    whole_calls,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


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
    segments = [segment.strip() for segment in text.split(TOOL_CALLS)[1:]]
    if not segments or not all(segments):
        return []
    if segments[0].startswith("["):  # the JSON list, one tag before it
        return _json_list(segments[0]) if len(segments) == 1 else []
    calls = [_named_call(segment) for segment in segments]
    return calls if all(call is not None for call in calls) else []  # type: ignore[return-value]


def _json_list(text: str) -> list[ParsedCall]:
    try:
        value = load_json(text)
    except ValueError:
        return []
    if not isinstance(value, list) or not value:
        return []
    calls = [call_from_object(item) for item in value]
    return calls if all(call is not None for call in calls) else []  # type: ignore[return-value]


def _named_call(segment: str) -> ParsedCall | None:
    """`name[ARGS]{...}`: one call, or None."""
    name, separator, arguments = segment.partition(ARGS)
    name = name.strip()
    if not separator or not name or any(character.isspace() for character in name):
        return None
    try:
        value = load_json(arguments)
    except ValueError:
        return None
    return make_call(name, value) if isinstance(value, dict) else None
