"""`StructuredOutputManager`: the engine's per-step grammar work. Before sampling, fill a token
bitmask for every constrained row and set the disallowed logits to -inf (so temperature, top-p/k,
penalties and logprobs all see the constrained distribution); after sampling, advance each
choice's matcher by its token. Runs on the engine thread; compiling happens elsewhere.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import xgrammar
from torch import Tensor

from pagedserve.configs import SamplingParams, StructuredOutputs
from pagedserve.engine.structured_outputs.compiler import GrammarCompiler
from pagedserve.engine.structured_outputs.limits import MAX_MASK_FILL_S
from pagedserve.engine.structured_outputs.think_gate import ThinkGatedMatcher

# A choice's grammar state: xgrammar's matcher, or one that leaves a think block free first.
Matcher = xgrammar.GrammarMatcher | ThinkGatedMatcher


class GrammarError(Exception):
    """A constrained choice cannot go on (it ends with "error"); the message is the client's."""


class GrammarRejectedError(GrammarError):
    """The grammar allows no token here (the sampled one was drawn from an all -inf row)."""

    def __init__(self) -> None:
        super().__init__("structured output: the grammar allows no further token")


class GrammarTooSlowError(GrammarError):
    """Masking one step of this choice took longer than MAX_MASK_FILL_S."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            f"structured output: the grammar took {seconds * 1e3:.1f} ms to mask one token (at "
            f"most {MAX_MASK_FILL_S * 1e3:.0f} ms: every request in the batch waits for it); "
            "simplify it"
        )


class StructuredOutputManager:
    """Owns the grammar compiler, one reusable bitmask buffer and the structured-output stats.

    A matcher's state is a function of the choice's output tokens only: it follows them through
    recompute preemption untouched (the KV cache is rebuilt, the tokens are not regenerated).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size  # the logits' full width (may exceed len(tokenizer))
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self._bitmask: Tensor | None = None  # [rows, ceil(vocab_size / 32)] int32, grown on demand
        self.num_constrained_requests = 0
        self.mask_times_s: deque[float] = deque(maxlen=100_000)  # per step with a constrained row
        self._slow_fills: dict[int, float] = {}  # id(matcher) -> seconds, this step's over-limit

    def new_matchers(
        self, grammar: xgrammar.CompiledGrammar, params: SamplingParams
    ) -> list[Matcher]:
        """One matcher per choice (each advances by its own tokens); where the constraint has a
        think block, each leaves it free (think_gate.py)."""
        self.num_constrained_requests += 1
        think = params.structured_outputs.think if params.structured_outputs else None
        matchers: list[Matcher] = [xgrammar.GrammarMatcher(grammar) for _ in range(params.n)]
        if think is not None:
            matchers = [ThinkGatedMatcher(matcher, think) for matcher in matchers]
        return matchers

    def compile(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        return self.compiler.compile(constraint)

    def apply(self, logits: Tensor, matchers: list[Matcher | None]) -> None:
        """Mask, in place, the rows of `logits` [num_rows, vocab_size] whose matcher is set (and
        not inside a think block it leaves free).

        A row whose grammar allows no token keeps an all -inf row: whatever is sampled there is
        then rejected by `advance`, which ends that choice (never a hang).
        """
        rows = [index for index, matcher in enumerate(matchers) if masks_next_token(matcher)]
        if not rows:
            return
        start = time.perf_counter()
        if logits.shape[-1] != self.vocab_size:
            raise RuntimeError(
                f"logits have {logits.shape[-1]} columns but the grammar masks {self.vocab_size}"
            )
        bitmask = self._bitmask_rows(len(matchers))
        self._slow_fills.clear()
        for index in rows:
            matcher = matchers[index]
            assert matcher is not None
            if matcher.is_terminated():  # finished choices are never scheduled; stay safe
                bitmask[index].zero_()
                continue
            fill_start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, index)
            seconds = time.perf_counter() - fill_start
            if seconds > MAX_MASK_FILL_S:  # `follow` ends this choice after this step's sample
                self._slow_fills[id(matcher)] = seconds
        xgrammar.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), indices=rows
        )
        self.mask_times_s.append(time.perf_counter() - start)

    @staticmethod
    def advance(matcher: Matcher, token_id: int) -> bool:
        """Feed the sampled token; False if the grammar rejects it (the choice must end)."""
        return bool(matcher.accept_token(token_id))

    def follow(self, matcher: Matcher, token_id: int) -> GrammarError | None:
        """After sampling: why this choice must end (its mask was too slow this step, or the
        grammar rejects the token), else None with the matcher advanced by the token."""
        seconds = self._slow_fills.get(id(matcher))
        if seconds is not None:
            return GrammarTooSlowError(seconds)
        return None if self.advance(matcher, token_id) else GrammarRejectedError()

    @staticmethod
    def is_complete(matcher: Matcher) -> bool:
        """True once the grammar accepted its stop token: the choice ends with "stop"."""
        return bool(matcher.is_terminated())

    def _bitmask_rows(self, num_rows: int) -> Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgrammar.allocate_token_bitmask(max(num_rows, 16), self.vocab_size)
        return self._bitmask[:num_rows]

    def shutdown(self) -> None:
        self.compiler.shutdown()


def masks_next_token(matcher: Matcher | None) -> bool:
    """Whether this row's next token is masked: it has a grammar, not waiting out a think block."""
    if isinstance(matcher, ThinkGatedMatcher):
        return matcher.masks_next_token
    return matcher is not None
