"""The parser contract: `feed` text as it streams and get back the content that is safe to show
now; `finish` once, for the held-back content and the calls found."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.server.json_input import load_json


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as a string


class ToolCallParser(Protocol):
    def feed(self, text: str) -> str: ...

    def finish(self) -> tuple[str, list[ParsedCall]]: ...


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
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could start `tag` (kept until the next chunk)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
