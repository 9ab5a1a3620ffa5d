"""The calls the structured-output layer forces (server/tools.py): for a named tool_choice the
reply is that tool's arguments object; for "required" a JSON list of `{"name", "arguments"}`
objects. Both stream piece by piece as the model writes them, since the grammar guarantees the
shape: a call is named as soon as its name is written, and its arguments' text follows as it
comes, exactly as the model wrote it (so the pieces and the whole response agree).

A reply cut short by max_tokens keeps the calls it began, the last one's arguments unfinished,
as vLLM's do (finish_reason "length" says so); one cut before it names any call is text.
"""

from __future__ import annotations

from pagedserve.server.json_input import load_json
from pagedserve.server.tool_parsers.base import CallDelta, is_utf8

_WHITESPACE = " \t\n\r"


class ForcedCallsParser:
    def __init__(self, named: str | None) -> None:
        self._named = named
        self._calls = _CallListScanner()
        self._text = ""  # the whole reply, for a "required" one that never named a call

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._named is None:
            self._text += text
            return "", self._calls.feed(text)
        if not text:
            return "", []
        first = not self._text
        self._text += text
        return "", [CallDelta(0, self._named if first else None, text)]

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._named is None and self._calls.num_named == 0:
            return self._text, []
        return "", []


class _CallListScanner:
    """Reads `[{"name": ..., "arguments": {...}}, ...]` a character at a time: depth 1 is the
    list, depth 2 a call object, deeper its arguments. Keys and the name are read at depth 2;
    the arguments' characters are passed on raw, from their first to their last."""

    def __init__(self) -> None:
        self.num_named = 0
        self._depth = 0
        self._in_string = self._escape = False
        self._string: str | None = None  # a key or value string at depth 2, raw, as it is read
        self._key: str | None = None  # the call object's current key
        self._expect_value = False  # at depth 2: after a ':' (else a key comes next)
        self._in_arguments = False
        self._index: int | None = None  # the current call's, once it is named
        self._piece = ""  # arguments read since the last delta
        self._early = ""  # arguments read before the call's name (kept until it comes)
        self._out: list[CallDelta] = []

    def feed(self, text: str) -> list[CallDelta]:
        for char in text:
            if self._in_arguments:
                self._arguments_char(char)
            elif self._in_string:
                self._string_char(char)
            else:
                self._structure_char(char)
        self._flush()
        out, self._out = self._out, []
        return out

    def _string_char(self, char: str) -> None:
        if self._string is not None:
            self._string += char
        if self._string_ends(char) and self._string is not None:
            self._end_string(self._string)
            self._string = None

    def _string_ends(self, char: str) -> bool:
        """One character inside a string: True when it closes the string (an unescaped quote)."""
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            return True
        return False

    def _end_string(self, raw: str) -> None:
        try:
            value = load_json(raw)
        except ValueError:
            return
        if not self._expect_value:
            self._key = value
        elif self._key == "name" and self._index is None and isinstance(value, str):
            if not is_utf8(value):  # a lone surrogate escape: no name UTF-8 can carry
                return
            self._index, self.num_named = self.num_named, self.num_named + 1
            self._out.append(CallDelta(self._index, value, self._early))
            self._early = ""

    def _structure_char(self, char: str) -> None:
        if char in _WHITESPACE:
            return
        if self._depth == 2 and self._expect_value and self._key == "arguments":
            self._in_arguments = True
            self._arguments_char(char)
        elif char == '"':
            self._in_string = True
            self._string = '"' if self._depth == 2 else None
        elif char in "{[":
            self._depth += 1
            if self._depth == 2 and char == "{":  # a new call
                self._index, self._key, self._expect_value, self._early = None, None, False, ""
        elif char in "}]":
            self._depth -= 1
        elif self._depth == 2 and char in ":,":
            self._expect_value = char == ":"

    def _arguments_char(self, char: str) -> None:
        if self._in_string:
            self._piece += char
            self._string_ends(char)
            return
        if self._depth == 2 and char in ",}":  # the end of a value that was not a container
            self._end_arguments()
            self._structure_char(char)
            return
        self._piece += char
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 2:
                self._end_arguments()

    def _end_arguments(self) -> None:
        self._flush()
        self._in_arguments = False
        self._key, self._expect_value = None, False

    def _flush(self) -> None:
        if not self._piece:
            return
        if self._index is None:
            self._early += self._piece
        else:
            self._out.append(CallDelta(self._index, None, self._piece))
        self._piece = ""
