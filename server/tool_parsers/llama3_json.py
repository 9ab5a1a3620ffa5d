"""Llama 3.x JSON calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`. A reply that does not start like one streams as
text; one that does but does not parse is returned as text at the end."""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers.base import ParsedCall, call_from_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    def __init__(self) -> None:
        self._text = ""
        self._decided: bool | None = None  # True: the reply is calls (held); False: plain text

    def feed(self, text: str) -> str:
        self._text += text
        if self._decided is None:
            stripped = self._text.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return ""  # too early to tell
            self._decided = stripped.startswith(("{", PYTHON_TAG))
            if not self._decided:
                shown, self._text = self._text, ""
                return shown
        if self._decided:
            return ""
        shown, self._text = self._text, ""
        return shown

    def finish(self) -> tuple[str, list[ParsedCall]]:
        text, self._text = self._text, ""
        if not self._decided:
            return text, []
        calls = _parse_calls(text.strip().removeprefix(PYTHON_TAG))
        return ("", calls) if calls else (text, [])


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
