"""Tool-call parsers: read calls back from a model's text, streamed or whole. One module per
output convention (vLLM's `--tool-call-parser` names); `ForcedCallsParser` reads the JSON that
the structured-output layer forces for `tool_choice` "required" or a named tool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedserve.server.tool_parsers.base import CallDelta, ParsedCall, ToolCallParser
from pagedserve.server.tool_parsers.forced import ForcedCallsParser
from pagedserve.server.tool_parsers.hermes import HermesParser
from pagedserve.server.tool_parsers.llama3_json import Llama3JsonParser
from pagedserve.server.tool_parsers.mistral import MistralParser
from pagedserve.server.tool_parsers.pythonic import PythonicParser
from pagedserve.server.tool_parsers.qwen3_coder import Qwen3CoderParser

# Name -> the parser for one reply, given the request's tools (Qwen3-Coder's reads each value as
# its parameter's type; the others take what the JSON says).
PARSERS: dict[str, Callable[[list[dict[str, Any]]], ToolCallParser]] = {
    "hermes": lambda tools: HermesParser(),
    "llama3_json": lambda tools: Llama3JsonParser(),
    "mistral": lambda tools: MistralParser(),
    "pythonic": lambda tools: PythonicParser(),
    "qwen3_coder": Qwen3CoderParser,
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
    "Qwen3CoderParser",
    "ToolCallParser",
]
