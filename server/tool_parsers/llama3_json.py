"""Llama 3.x JSON calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`. A reply that does not start like one streams as
text; one that does but does not parse is returned as text at the end (so its calls, all or
none, come at the end too)."""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    call_from_object,
    whole_calls,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    def __init__(self) -> None:
        self._text = ""
        self._decided: bool | None = None  # True: the reply is calls (held); False: plain text

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._text += text
        if self._decided is None:
            stripped = self._text.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return "", []  # too early to tell
            self._decided = stripped.startswith(("{", PYTHON_TAG))
        if self._decided:
            return "", []
        shown, self._text = self._text, ""
        return shown, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        text, self._text = self._text, ""
        if not self._decided:
            return text, []
        calls = _parse_calls(text.strip().removeprefix(PYTHON_TAG))
        return ("", whole_calls(calls)) if calls else (text, [])


def _parse_calls(text: str) -> list[ParsedCall]:
    """Every `;`-separated JSON call, or [] if any part is not one."""
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            return []
        call = call_from_object(value, "parameters")
        if call is None:
            return []
        calls.append(call)
        position = len(text) - len(text[position:].lstrip().removeprefix(";").lstrip())
    return calls
