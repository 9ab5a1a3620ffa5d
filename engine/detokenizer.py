"""Incremental detokenization and stops: text deltas that never split a UTF-8 character and never
leak (the start of) a stop string, or of a stop pattern's match where its length is bounded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.configs.stop_regex import stop_pattern

if TYPE_CHECKING:
    from pagedserve.configs.stop_regex import StopPattern
    from pagedserve.scheduler import Request

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
        stop_regex: tuple[str, ...] = (),
    ) -> None:
        """`stop_token_ids`: the tokens that end the output once `min_tokens` are out (EOS unless
        ignored, the request's stop_token_ids); their text is left out, as a stop string's is,
        unless `include_stop_str_in_output`. Stop strings count only from the token after the
        first `min_tokens` (vLLM's rule), as EOS and stop tokens are banned until then.
        `skip_special_tokens` false keeps special tokens' text (a template's tags).
        `stop_regex` (SGLang's): the text ends where it first matches one, cut as at a stop
        string, counting from the first character after `min_tokens`. Text that may begin a
        match is held back where its length is bounded; an unbounded pattern may match text
        already emitted, and the output then ends where it stands."""
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
        self._patterns = tuple(stop_pattern(p) for p in stop_regex)
        self._regex_from = 0  # where in the whole output text a pattern's match may start
        # Chars that may start a stop string or a pattern's match.
        holds = [len(s) - 1 for s in stop] + [p.hold for p in self._patterns]
        self._hold = max(holds, default=0)
        self._pending = ""  # decoded but not yet emitted
        self.text = ""  # everything emitted so far
        self.matched_stop: str | None = None  # the stop string or pattern that ended the text

    @classmethod
    def for_sequence(cls, tokenizer: Any, sequence: Request) -> IncrementalDetokenizer:
        """A choice's detokenizer, as its sampling params ask: its EOS (unless ignored) and stop
        token ids end it, its stop strings and patterns cut it."""
        params = sequence.sampling_params
        eos = () if params.ignore_eos else (sequence.eos_token_id,)
        return cls(
            tokenizer,
            sequence.prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset((*eos, *params.stop_token_ids)),
            skip_special_tokens=params.skip_special_tokens,
            stop_regex=params.stop_regex,
        )

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
            self._regex_from = len(self.text) + len(text)
            return text, False
        found = ((text.find(s, max(0, new_from - len(s) + 1)), s) for s in self._stop)
        hits = [(index, index + len(s), s) for index, s in found if index >= 0]
        for pattern in self._patterns:
            span = self._search(pattern, text, len(self.text) + new_from)
            if span is not None:
                hits.append((*span, pattern.text))
        if not hits:
            return text, False
        start, end, stop = min(hits)
        self.matched_stop = stop
        return text[: end if self._include_stop else start], True

    def _search(self, pattern: StopPattern, text: str, new_at: int) -> tuple[int, int] | None:
        """The first match of `pattern` that new text (from `new_at` in the whole output) can
        have completed, as (start, end) in the unemitted `text` (0 for what was emitted):
        searched from its reach before the new text, never before `_regex_from`, with one more
        character as context for assertions. RE2: linear in that window."""
        start = max(self._regex_from, new_at - pattern.reach)
        begin, emitted = start - (start > 0), len(self.text)
        window = self.text[begin:] + text if begin < emitted else text[begin - emitted :]
        match = pattern.compiled.search(window, start - begin)
        if match is None:
            return None
        return max(0, begin + match.start() - emitted), max(0, begin + match.end() - emitted)
