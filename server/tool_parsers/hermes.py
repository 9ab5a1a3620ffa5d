"""Hermes-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
after optional text (Hermes 2 Pro, Qwen 2.5, and this server's fallback prompt block). A block
whose JSON does not parse stays in the content, as the model wrote it."""

from __future__ import annotations

import re

from pagedserve.server.json_input import load_json
from pagedserve.server.tool_parsers.base import ParsedCall, call_from_object, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class HermesParser:
    """Streams text until the first `<tool_call>`; from there on holds everything for `finish`."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet shown (a possible tag start, or everything after one)
        self._in_calls = False

    def feed(self, text: str) -> str:
        self._pending += text
        if self._in_calls:
            return ""
        start = self._pending.find(OPEN)
        if start >= 0:
            self._in_calls = True
            shown, self._pending = self._pending[:start], self._pending[start:]
            return shown
        keep = held_back(self._pending, OPEN)
        shown = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(shown) :]
        return shown

    def finish(self) -> tuple[str, list[ParsedCall]]:
        text, self._pending = self._pending, ""
        if not self._in_calls:
            return text, []
        calls: list[ParsedCall] = []
        content: list[str] = []
        position = 0
        for match in _BLOCK.finditer(text):
            content.append(text[position : match.start()])
            position = match.end()
            try:
                call = call_from_object(load_json(match.group(1)))
            except ValueError:
                call = None
            if call is None:
                content.append(match.group(0))  # malformed: left as the model wrote it
            else:
                calls.append(call)
        content.append(text[position:])
        # Only text from the first tag on is here (what came before was streamed by `feed`):
        # the whitespace between calls is the model's layout, not content.
        return "".join(content).strip(), calls
