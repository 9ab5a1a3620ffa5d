"""`NgramProposer`: prompt-lookup drafts, from an index that grows with each request.

For a request whose context ends with the n-gram g (n from `prompt_lookup_max` down to
`prompt_lookup_min`), the draft is the K tokens that followed the latest earlier occurrence of g in
prompt + output. Each request keeps, per n, a dict from n-gram to the position just after its
latest occurrence; appending a token adds one n-gram per n, so a step costs O(max - min + 1 + K)
whatever the context length (no scan). Pure Python, keyed by sequence id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _NgramIndex:
    # index[n - min_n]: n-gram -> the position right after its latest occurrence indexed so far
    index: list[dict[tuple[int, ...], int]]
    num_indexed: int = 0  # n-grams ending before this position are in `index`
    num_drafted: int = 0  # drafts and acceptances in the current window, for the gate
    num_accepted: int = 0
    paused_steps: int = 0  # steps left without drafting after a low-acceptance verdict


class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts per request from its own tokens."""

    # After this many drafted tokens, a request below `min_acceptance_rate` pauses drafting for
    # `_PAUSE_STEPS` steps, then tries again (its text may turn repetitive later).
    _GATE_MIN_DRAFTS = 16
    _PAUSE_STEPS = 32

    def __init__(
        self, num_speculative_tokens: int, min_n: int, max_n: int, min_acceptance_rate: float = 0.0
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.min_acceptance_rate = min_acceptance_rate
        self._sequences: dict[str, _NgramIndex] = {}

    def propose(self, sequence_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Drafts that would follow `token_ids` (at most min(K, max_drafts); maybe none)."""
        state = self._sequences.get(sequence_id)
        if state is None:
            state = _NgramIndex([{} for _ in range(self.min_n, self.max_n + 1)])
            self._sequences[sequence_id] = state
        num_tokens = len(token_ids)
        # Index every n-gram ending before the last token: an occurrence of the suffix must start
        # earlier than the suffix itself, and it must be followed by at least one token.
        self._extend(state, token_ids, num_tokens - 1)
        if state.paused_steps > 0:
            state.paused_steps -= 1
            return []
        max_drafts = min(max_drafts, self.num_speculative_tokens)
        if max_drafts <= 0:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = state.index[n - self.min_n].get(tuple(token_ids[num_tokens - n :]))
            if start is not None:
                return list(token_ids[start : min(start + max_drafts, num_tokens)])
        return []

    def _extend(self, state: _NgramIndex, token_ids: Sequence[int], end: int) -> None:
        for pos in range(state.num_indexed, end):  # n-grams ending at `pos`, followed by pos + 1
            for n in range(self.min_n, min(self.max_n, pos + 1) + 1):
                state.index[n - self.min_n][tuple(token_ids[pos + 1 - n : pos + 1])] = pos + 1
        state.num_indexed = max(state.num_indexed, end)

    def record(self, sequence_id: str, num_drafted: int, num_accepted: int) -> None:
        """Feed back a verified step: pauses a request whose recent drafts are mostly rejected."""
        state = self._sequences.get(sequence_id)
        if state is None or num_drafted == 0:
            return
        state.num_drafted += num_drafted
        state.num_accepted += num_accepted
        if state.num_drafted >= self._GATE_MIN_DRAFTS:
            if state.num_accepted < self.min_acceptance_rate * state.num_drafted:
                state.paused_steps = self._PAUSE_STEPS
            state.num_drafted, state.num_accepted = 0, 0  # a fresh window

    def drop(self, sequence_id: str) -> None:
        self._sequences.pop(sequence_id, None)
