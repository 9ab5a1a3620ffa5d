"""Tool-call parsers: read calls back from a model's text, streamed or whole. One module per
output convention (vLLM's `--tool-call-parser` names); `json_calls` reads the JSON that the
structured-output layer forces for `tool_choice` "required" or a named tool."""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.server.tool_parsers.base import ParsedCall, ToolCallParser
from pagedserve.server.tool_parsers.hermes import HermesParser
from pagedserve.server.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}

__all__ = ["PARSERS", "HermesParser", "Llama3JsonParser", "ParsedCall", "ToolCallParser"]
