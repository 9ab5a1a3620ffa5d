"""Llama 3.x JSON calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`. A reply that does not start like one streams as
text; one that does but does not parse is returned as text at the end (so its calls, all or
none, come at the end too)."""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers.base import ParsedCall, WholeReplyParser, call_from_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(WholeReplyParser):
    TAG = PYTHON_TAG
    OPENERS = ("{",)

    def parse(self, text: str) -> list[ParsedCall]:
        return _parse_calls(text)


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
