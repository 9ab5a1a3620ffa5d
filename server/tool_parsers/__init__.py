"""Tool-call parsers: read calls back from a model's text, streamed or whole. One module per
output convention (vLLM's `--tool-call-parser` names); `ForcedCallsParser` reads the JSON that
the structured-output layer forces for `tool_choice` "required" or a named tool."""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.server.tool_parsers.base import CallDelta, ParsedCall, ToolCallParser
from pagedserve.server.tool_parsers.forced import ForcedCallsParser
from pagedserve.server.tool_parsers.hermes import HermesParser
from pagedserve.server.tool_parsers.llama3_json import Llama3JsonParser
from pagedserve.server.tool_parsers.mistral import MistralParser
from pagedserve.server.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}

__all__ = [
    "PARSERS",
    "CallDelta",
    "ForcedCallsParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedCall",
    "PythonicParser",
    "ToolCallParser",
]
