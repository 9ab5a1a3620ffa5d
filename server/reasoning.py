"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model writes its reasoning between
`<think>` and `</think>`, then its answer. The chat route returns the two apart: the reasoning in
the message's (or delta's) `reasoning` field, as vLLM does, the rest as `content` (which a tool
parser then reads).

- `deepseek_r1`: the reply starts inside the reasoning (R1's template opens `<think>` in the
  prompt; a `<think>` the model writes anyway is dropped), unless the prompt or an assistant
  prefill closed it already. A reply that never closes it is all reasoning.
- `qwen3`: the reply is reasoning only inside a think block: one the model opens at its start,
  one the rendered prompt opens at its end (Qwen3's thinking-only templates), or one an assistant
  prefill left open (`continue_final_message`). Otherwise (thinking off, `enable_thinking:
  false`) it is all content.

Tags split across chunks are held back until they can be told apart from text. The text after
`</think>` is the content as written, its leading newlines included (as vLLM returns it).

An output constraint (a schema, a forced tool call) shapes the answer, not the reasoning: where
the tokenizer has each tag as one token (Qwen3's, DeepSeek-R1's), the grammar waits until the
think block has closed (`leave_thinking_free`; the engine's think_gate.py), as vLLM and SGLang do,
and the reply is split as any other. Elsewhere the grammar shapes the whole reply from its first
token, and it is not split (the chat route passes no splitter).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagedserve.configs import SamplingParams, ThinkBlock
from pagedserve.server.tool_parsers.base import held_back

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def opens_in_reasoning(parser: str, prompt_text: str, prefill: str = "") -> bool:
    """Whether the reply starts inside a think block. `prefill`: the assistant message the reply
    continues (continue_final_message), if any. A `<think>` elsewhere in the prompt (a user
    asking about the tag) does not count."""
    if prompt_text.rstrip().endswith(CLOSE) or prefill.rfind(CLOSE) > prefill.rfind(OPEN):
        return False  # the prompt closed the block already (thinking off, or a prefill)
    if parser == "deepseek_r1":
        return True
    return prompt_text.rstrip().endswith(OPEN) or prefill.rfind(OPEN) > prefill.rfind(CLOSE)


def leave_thinking_free(
    params: SamplingParams, parser: str | None, tokenizer: Any, inside: bool
) -> SamplingParams:
    """`params` with its output constraint applied after the think block, under a reasoning
    parser and a tokenizer whose tags are one token each; else `params` as they are. `inside`:
    the reply starts in the block (opens_in_reasoning)."""
    constraint = params.structured_outputs
    if parser is None or constraint is None:
        return params
    tags = [tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)]
    if any(len(ids) != 1 for ids in tags):
        return params
    think = ThinkBlock(tags[0][0], tags[1][0], inside)
    return replace(params, structured_outputs=replace(constraint, think=think))


class ReasoningSplitter:
    """Splits one choice's streamed text into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool) -> None:
        self._state = "start"  # start (an opening tag may come), reasoning, content
        self._default = "reasoning" if in_reasoning else "content"
        self._pending = ""  # text held back: a possible tag, or leading whitespace

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning = content = ""
        while True:
            if self._state == "start":
                stripped = self._pending.lstrip()
                if stripped.startswith(OPEN):
                    self._state, self._pending = "reasoning", stripped[len(OPEN) :]
                elif OPEN.startswith(stripped):  # empty, or a tag not yet whole
                    return reasoning, content
                else:
                    self._state = self._default
            elif self._state == "reasoning":
                end = self._pending.find(CLOSE)
                if end < 0:
                    keep = held_back(self._pending, CLOSE)
                    reasoning += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    return reasoning, content
                reasoning += self._pending[:end]
                self._state, self._pending = "content", self._pending[end + len(CLOSE) :]
            else:
                content += self._pending
                self._pending = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text still held back: an unfinished tag is text of the part it is in."""
        text, self._pending = self._pending, ""
        if self._state == "reasoning" or (self._state == "start" and self._default == "reasoning"):
            return text, ""
        return "", text
