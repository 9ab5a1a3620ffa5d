"""The parser contract: `feed` text as it streams and get back the content that is safe to show
now and the pieces of calls that are ready; `finish` once, for the held-back content and the
calls' last pieces.

A call streams as pieces (`CallDelta`): its first piece names it, and its pieces' arguments
concatenate to its arguments' JSON text. A parser hands out a call as soon as it can stand by it:
the forced parser (forced.py) piece by piece as the model writes the arguments, the Hermes parser
when a call's block closes, the Llama 3 parser at the end (its calls are all or nothing).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.server.json_input import load_json


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as a string


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of the reply's call `index` (0, 1, ... in the order they were written)."""

    index: int
    name: str | None = None  # on the call's first piece only
    arguments: str = ""  # the next piece of its arguments' JSON text


class ToolCallParser(Protocol):
    def feed(self, text: str) -> tuple[str, list[CallDelta]]: ...

    def finish(self) -> tuple[str, list[CallDelta]]: ...


def whole_calls(calls: Iterable[ParsedCall], first_index: int = 0) -> list[CallDelta]:
    """Complete calls as one piece each, numbered from `first_index`."""
    return [
        CallDelta(index, call.name, call.arguments)
        for index, call in enumerate(calls, start=first_index)
    ]


class WholeReplyParser:
    """A reply that is either calls, told by how it starts (after an optional tag), or text.
    Text streams as it comes; calls are held to the end and read whole by `parse`, all or none:
    a reply that starts like calls but does not parse is returned as the text it was."""

    TAG = ""  # an optional tag before the calls (a special token that may be shown)
    OPENERS: tuple[str, ...] = ()  # how the calls start, after the tag

    def __init__(self) -> None:
        self._text = ""
        self._decided: bool | None = None  # True: the reply is calls (held); False: plain text

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._text += text
        if self._decided is None:
            stripped = self._text.lstrip()
            if not stripped or (self.TAG and self.TAG.startswith(stripped)):
                return "", []  # too early to tell
            self._decided = stripped.startswith((*self.OPENERS, *((self.TAG,) if self.TAG else ())))
        if self._decided:
            return "", []
        shown, self._text = self._text, ""
        return shown, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        text, self._text = self._text, ""
        if not self._decided:
            return text, []
        calls = self.parse(text.strip().removeprefix(self.TAG).strip())  # TAG "": no-op
        return ("", whole_calls(calls)) if calls else (text, [])

    def parse(self, text: str) -> list[ParsedCall]:
        """The calls `text` holds (the tag removed), or [] if it is not all calls."""
        raise NotImplementedError


def call_from_object(value: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """`{"name": str, arguments_key: object}` as a call; anything else is None (not a call)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models send the arguments already encoded
        try:
            arguments = load_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return make_call(value["name"], arguments)


def make_call(name: str, arguments: dict[str, Any]) -> ParsedCall | None:
    """A call of `name` with these arguments as JSON text; None (not a call) where either holds a
    lone surrogate, which a JSON escape (`"\\ud800"`) can spell but UTF-8 cannot carry."""
    text = json.dumps(arguments, ensure_ascii=False)
    if not is_utf8(name) or not is_utf8(text):
        return None
    return ParsedCall(name, text)


def is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could start `tag` (kept until the next chunk)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
