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


def assemble(deltas: Iterable[CallDelta]) -> list[ParsedCall]:
    """The calls that the pieces make up, in index order."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    return [ParsedCall(names[index], arguments.get(index, "")) for index in sorted(names)]


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
