"""`ThinkGatedMatcher`: a choice's grammar that waits until the model has reasoned.

A reasoning model writes `<think>` ... `</think>` before its answer. A constraint on the answer
(a JSON schema, a forced tool call) must not constrain the reasoning, or the model cannot think:
vLLM and SGLang start the grammar after the think block under a `--reasoning-parser`. This matcher
does the same over token ids (each tag is one token, `configs.ThinkBlock`), in three states:

    start     the reply may open the block with its first token: the grammar's mask plus the
              opening tag; any other first token is the answer's, fed to the grammar
    thinking  free text: no mask, nothing fed to the grammar, until the closing tag
    answer    the grammar, fed every token after the closing tag

A reply that starts inside the block (`ThinkBlock.inside`: the prompt opened it) begins in
`thinking`. Like the grammar's own state, this one is a function of the choice's output tokens
only, so it follows them through recompute preemption untouched.
"""

from __future__ import annotations

import xgrammar
from torch import Tensor

from pagedserve.configs import ThinkBlock


class ThinkGatedMatcher:
    """The calls the engine makes on xgrammar's `GrammarMatcher`, with the think block left free."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, think: ThinkBlock) -> None:
        self._matcher = matcher
        self._think = think
        self._state = "thinking" if think.inside else "start"

    @property
    def masks_next_token(self) -> bool:
        """False inside the think block: the next token is free."""
        return self._state != "thinking"

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int) -> None:
        """The grammar's mask of the next token into row `index`; at the start, the opening tag
        allowed too. Not called while thinking (`masks_next_token`)."""
        self._matcher.fill_next_token_bitmask(bitmask, index)
        if self._state == "start":
            word, bit = divmod(self._think.open_token_id, 32)
            # int32 words: bit 31 is the sign bit (a Python `1 << 31` would not fit).
            bitmask[index, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one output token; False if the grammar rejects it."""
        if self._state == "thinking":
            if token_id == self._think.close_token_id:
                self._state = "answer"
            return True
        if self._state == "start":
            if token_id == self._think.open_token_id:
                self._state = "thinking"
                return True
            self._state = "answer"
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        """True once the answer's grammar accepted its stop token."""
        return self._state == "answer" and bool(self._matcher.is_terminated())
