"""Logprobs in the response formats: OpenAI's legacy completions lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), with the echoed prompt first, and vLLM's
`prompt_logprobs` (per prompt token, a dict keyed by token id)."""

from __future__ import annotations

import codecs
from typing import Any

from fastapi import Request

from pagedserve.engine.outputs import RequestDelta, TokenLogprob
from pagedserve.server.errors import invalid_request
from pagedserve.server.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs
from pagedserve.server.token_bytes import token_bytes, token_name


def check_logprobs_cap(request: Request, **counts: int | None) -> None:
    """A 400 naming the request's own field (`top_logprobs`, `top_logprobs_num`...) where it asks
    for more alternatives per token than `--max-logprobs` allows (the engine holds every request
    to the same cap, in its own field names)."""
    cap = request.app.state.config.model.max_logprobs
    for name, count in counts.items():
        if cap != -1 and count is not None and count > cap:
            raise invalid_request(
                f"{name}: {count} alternatives per token requested, more than the server returns "
                f"({cap}, --max-logprobs)",
                name,
            )


def check_streamed_prompt_logprobs(body: Any, advice: str = "") -> None:
    """Prompt logprobs are not streamed: any count, 0 included (each prompt token's own logprob),
    is a 400 naming the field with `stream` (vLLM accepts 0 and drops what it computed)."""
    if body.stream and body.prompt_logprobs is not None:
        raise invalid_request(
            f"prompt_logprobs is not available when streaming{advice}.", "prompt_logprobs"
        )


def resolve_logprobs_counts(request: Request, body: Any, *names: str) -> None:
    """vLLM's -1 in the fields `names` of `body` (the whole vocabulary per token) as the
    vocabulary's size, then `check_logprobs_cap`: so only a server started with `--max-logprobs
    -1` (or a cap as large as the vocabulary) answers it."""
    vocab_size = request.app.state.engine.vocab_size
    for name in names:
        if getattr(body, name) == -1:
            setattr(body, name, vocab_size)
    check_logprobs_cap(request, **{name: getattr(body, name) for name in names})


def prompt_logprobs_body(
    tokenizer: Any, entries: tuple[TokenLogprob | None, ...], num_top: int
) -> PromptLogprobs:
    """vLLM's shape: None for the first token, then the prompt token and `num_top` alternatives."""
    body: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            body.append(None)
            continue
        position = {
            str(token_id): PromptLogprob(
                logprob=value, rank=rank, decoded_token=tokenizer.decode([token_id])
            )
            for rank, (token_id, value) in enumerate(entry.top_logprobs[:num_top], start=1)
        }
        position[str(entry.token_id)] = PromptLogprob(
            logprob=entry.logprob,
            rank=entry.rank,
            decoded_token=tokenizer.decode([entry.token_id]),
        )
        body.append(position)
    return body


class ChoiceText:
    """Text and legacy logprobs of one completion choice as it grows.

    With `echo`, the prompt's text (and, when logprobs are asked for, its tokens' logprobs) comes
    first, with the choice's first piece. `text_offset` counts characters from the start of the
    choice's text: the prompt's tokens from 0, the generated ones from the end of the prompt. A
    token's offset is where its first character starts, counted over the tokens' bytes (a token
    that ends inside a character adds nothing until the one that completes it), so offsets never
    go backwards and never pass the text, as counting each token's decoded text alone (U+FFFD
    for half an emoji) did.
    """

    def __init__(
        self,
        tokenizer: Any,
        prefix: str,
        prompt_token_ids: list[int],
        num_echo_top: int | None = None,
        tokens_as_ids: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids: "token_id:<id>"
        self.pending_prefix = prefix  # the echoed prompt, sent with the first piece
        self.num_chars = len(prefix)
        self.prompt_token_ids = prompt_token_ids
        self.num_echo_top = num_echo_top  # None: no prompt logprobs in the legacy lists
        self.generated_chars = _utf8_decoder()  # holds a character's bytes until it is whole

    def take(self, delta: RequestDelta) -> tuple[str, CompletionLogprobs | None]:
        """This delta's piece of text and logprobs (the pending echo first)."""
        text, self.pending_prefix = self.pending_prefix + delta.new_text, ""
        logprobs = None
        if self.num_echo_top is not None and delta.prompt_logprobs is not None:
            logprobs = CompletionLogprobs()
            num_prompt_chars, prompt_chars = 0, _utf8_decoder()
            for token_id, entry in zip(self.prompt_token_ids, delta.prompt_logprobs, strict=True):
                num_prompt_chars = self._append(
                    logprobs, token_id, entry, num_prompt_chars, prompt_chars, self.num_echo_top
                )
        if delta.new_logprobs is not None:
            logprobs = logprobs or CompletionLogprobs()
            for entry in delta.new_logprobs:
                self.num_chars = self._append(
                    logprobs, entry.token_id, entry, self.num_chars, self.generated_chars, None
                )
        return text, logprobs

    def _append(
        self,
        logprobs: CompletionLogprobs,
        token_id: int,
        entry: TokenLogprob | None,
        offset: int,
        chars: codecs.IncrementalDecoder,
        num_top: int | None,
    ) -> int:
        """Add one token; returns the offset after it. `entry` None: the prompt's first token."""
        token = token_name(self.tokenizer, token_id, self.tokens_as_ids)
        logprobs.tokens.append(token)
        logprobs.text_offset.append(offset)
        offset += len(chars.decode(token_bytes(self.tokenizer, token_id)))
        if entry is None:
            logprobs.token_logprobs.append(None)
            logprobs.top_logprobs.append(None)
            return offset
        alternatives = entry.top_logprobs if num_top is None else entry.top_logprobs[:num_top]
        top = {
            token_name(self.tokenizer, token_id, self.tokens_as_ids): value
            for token_id, value in alternatives
        }
        # The chosen token is always listed, with its own value even when another token of
        # the top list decodes to the same text (the legacy format keys them by text).
        top[token] = entry.logprob
        logprobs.token_logprobs.append(entry.logprob)
        logprobs.top_logprobs.append(top)
        return offset


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")
