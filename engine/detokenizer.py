"""Incremental detokenization and stop strings: text deltas that never split a UTF-8 character
and never leak (the start of) a stop string."""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 5  # decoding starts a few prompt tokens back, so leading spaces survive


class IncrementalDetokenizer:
    """Turns one choice's output tokens into text, a delta at a time."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        *,
        min_tokens: int = 0,
        stop_token_ids: frozenset[int] = frozenset(),
        skip_special_tokens: bool = True,
    ) -> None:
        """`stop_token_ids`: the tokens that end the output once `min_tokens` are out (EOS unless
        ignored, the request's stop_token_ids); their text is left out, as a stop string's is,
        unless `include_stop_str_in_output`. Stop strings count only from the token after the
        first `min_tokens` (vLLM's rule), as EOS and stop tokens are banned until then.
        `skip_special_tokens` false keeps special tokens' text (a template's tags)."""
        self.tokenizer = tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._token_ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._stop_token_ids = stop_token_ids
        self._num_output_tokens = 0
        self._skip_special_tokens = skip_special_tokens
        self._hold = (
            max((len(s) for s in stop), default=1) - 1
        )  # chars that may start a stop string
        self._pending = ""  # decoded but not yet emitted
        self.text = ""  # everything emitted so far
        self.matched_stop: str | None = None  # the stop string that ended the text, once one has

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return full_text[len(prefix_text) :]

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed new tokens; returns (text safe to emit now, whether a stop string matched)."""
        self._num_output_tokens += len(token_ids)
        if token_ids and token_ids[-1] in self._stop_token_ids and not self._include_stop:
            token_ids = token_ids[:-1]  # ends the output (banned before): no text of its own
        self._token_ids.extend(token_ids)
        held = len(self._pending)
        self._pending += self._decode_new()
        emitted, hit = self._cut_at_stop(self._pending, held)
        if hit:
            self._pending = ""
            self.text += emitted
            return emitted, True
        cut = max(0, len(self._pending) - self._hold)
        emitted, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += emitted
        return emitted, False

    def flush(self) -> tuple[str, bool]:
        """At the end: emit whatever is held back, including a trailing partial character, cut
        at a stop string that only this held-back text completes. Returns (text, stop hit)."""
        tail = self._decode(self._token_ids[self._prefix_offset :])
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        emitted, hit = self._cut_at_stop(
            self._pending + tail[len(prefix_text) :], len(self._pending)
        )
        self._pending = ""
        self.text += emitted
        return emitted, hit

    def _cut_at_stop(self, text: str, new_from: int) -> tuple[str, bool]:
        """`text` up to the earliest stop string that ends in its new part (from `new_from`),
        the stop string included if asked, and whether one was found. Held text was searched
        when it was new, or not at all while the output had at most `min_tokens` tokens: a stop
        string lying wholly in it does not count later either (vLLM's window)."""
        if self._num_output_tokens <= self._min_tokens:
            return text, False
        hits = ((text.find(s, max(0, new_from - len(s) + 1)), s) for s in self._stop)
        hit = min(((i, s) for i, s in hits if i >= 0), default=None)
        if hit is None:
            return text, False
        index, stop = hit
        self.matched_stop = stop
        return text[: index + (len(stop) if self._include_stop else 0)], True
