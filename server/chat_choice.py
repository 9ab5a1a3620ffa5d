"""One chat choice's text on its way out, streamed or whole: the reasoning split off first
(server/reasoning.py, with a `--reasoning-parser`), then the rest read by the tool parser
(server/tool_parsers, with tools), whose calls go out in OpenAI's streamed shape (server/tools.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.server.protocol import ChatLogprobs
from pagedserve.server.reasoning import ReasoningSplitter
from pagedserve.server.tool_parsers import ToolCallParser
from pagedserve.server.tool_protocol import ToolCallDelta
from pagedserve.server.tools import OpenAICalls


@dataclass(slots=True)
class ChoicePiece:
    """What one piece of a choice's text becomes: reasoning, content (both possibly "") and
    pieces of tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: ChoicePiece) -> ChoicePiece:
        return ChoicePiece(
            self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls
        )


class ChatChoiceText:
    """A choice's text as it streams, and what the non-streamed reply gathers of it."""

    def __init__(
        self,
        parser: ToolCallParser | None = None,
        reasoning: ReasoningSplitter | None = None,
        parallel_calls: bool = True,
        call_id: Callable[[], str] | None = None,
    ) -> None:
        self.parser = parser
        self.reasoning = reasoning
        # parallel_calls False: at most one call (forced calls' grammar enforces it; auto's here)
        self.calls = OpenAICalls(None if parallel_calls else 1, call_id)
        self.text = ""  # the non-streamed reply's whole text
        self.token_ids: list[int] = []
        self.logprobs: ChatLogprobs | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # vLLM's: the stop string or token that ended it

    def take(self, text: str) -> ChoicePiece:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return ChoicePiece(reasoning, *self._parse(content, finish=False))

    def finish(self, finish_reason: str | None) -> ChoicePiece:
        """The held-back text and the calls' last pieces; "stop" becomes "tool_calls" when the
        choice made calls."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        piece = ChoicePiece(reasoning, *self._parse(content, finish=True))
        made_calls = self.calls.num_calls > 0 and finish_reason == "stop"
        self.finish_reason = "tool_calls" if made_calls else finish_reason
        return piece

    def _parse(self, content: str, finish: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.parser is None:
            return content, []
        shown, pieces = self.parser.feed(content)
        if finish:
            tail, last = self.parser.finish()
            shown, pieces = shown + tail, pieces + last
        return shown, self.calls.deltas(pieces)
