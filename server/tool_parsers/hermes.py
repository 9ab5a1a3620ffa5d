"""Hermes-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
after optional text (Hermes 2 Pro, Qwen 2.5, and this server's fallback prompt block). A block
whose JSON does not parse stays in the content, as the model wrote it."""

from __future__ import annotations

import re

from pagedserve.server.json_input import load_json
from pagedserve.server.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    call_from_object,
    held_back,
    whole_calls,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class HermesParser:
    """Streams text until the first `<tool_call>`; from there on, each call as its block closes,
    and the text around the blocks (and any malformed block) at `finish`."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet shown (a possible tag start, or everything after one)
        self._in_calls = False
        self._content: list[str] = []  # text between and after the blocks read so far
        self._num_calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._pending += text
        if not self._in_calls:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = held_back(self._pending, OPEN)
                shown = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(shown) :]
                return shown, []
            self._in_calls = True
            shown, self._pending = self._pending[:start], self._pending[start:]
            return shown, self._closed_blocks()
        return "", self._closed_blocks()

    def finish(self) -> tuple[str, list[CallDelta]]:
        text, self._pending = self._pending, ""
        if not self._in_calls:
            return text, []
        calls = self._read_blocks(text)  # a last block may be unclosed
        # Only text from the first tag on is here (what came before was streamed by `feed`):
        # the whitespace between calls is the model's layout, not content.
        return "".join(self._content).strip(), calls

    def _closed_blocks(self) -> list[CallDelta]:
        """The calls of the blocks closed so far, taken out of the pending text."""
        end = self._pending.rfind(CLOSE)
        if end < 0:
            return []
        end += len(CLOSE)
        done, self._pending = self._pending[:end], self._pending[end:]
        return self._read_blocks(done)

    def _read_blocks(self, text: str) -> list[CallDelta]:
        calls: list[ParsedCall] = []
        position = 0
        for match in _BLOCK.finditer(text):
            self._content.append(text[position : match.start()])
            position = match.end()
            try:
                call = call_from_object(load_json(match.group(1)))
            except ValueError:
                call = None
            if call is None:
                self._content.append(match.group(0))  # malformed: left as the model wrote it
            else:
                calls.append(call)
        self._content.append(text[position:])
        deltas = whole_calls(calls, self._num_calls)
        self._num_calls += len(calls)
        return deltas
