"""Per-HTTP-request bookkeeping: token usage, latency metrics per choice, and the one log line.

A choice counts as one request in the metrics, as in vLLM V1 where `n > 1` fans out into n
requests; so does each prompt of a batched /v1/completions call. The engine-side phase times
(queue, prefill, decode) are the exception: one per prompt, from its earliest-scheduled choice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.outputs import RequestDelta
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import PromptTokensDetails, UsageInfo

if TYPE_CHECKING:
    from starlette.requests import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _ChoiceState:
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None


def usage_so_far(delta: RequestDelta) -> UsageInfo:
    """One choice's usage up to this delta (vLLM's continuous_usage_stats)."""
    return UsageInfo(
        prompt_tokens=delta.num_prompt_tokens,
        completion_tokens=delta.num_output_tokens,
        total_tokens=delta.num_prompt_tokens + delta.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=delta.num_cached_prompt_tokens),
    )


class RequestRecorder:
    """Observes the deltas of one HTTP request (`(prompt_idx, delta)`) until `close()`."""

    def __init__(
        self,
        metrics: ServerMetrics,
        request_id: str,
        arrival_time: float,
        prompt_lengths: list[int],
        n: int,
    ) -> None:
        self.metrics = metrics
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.prompt_lengths = prompt_lengths
        self.choices = {
            (prompt_idx, index): _ChoiceState()
            for prompt_idx in range(len(prompt_lengths))
            for index in range(n)
        }
        self.num_cached_prompt_tokens = [0] * len(prompt_lengths)  # per prompt, from the engine
        self.is_closed = False

    @classmethod
    def of(cls, request: Request, prompt_lengths: list[int], n: int) -> RequestRecorder:
        """The recorder of HTTP `request` (its id and arrival, set by the middleware)."""
        state = request.state
        return cls(
            request.app.state.metrics, state.request_id, state.arrival_time, prompt_lengths, n
        )

    def observe(self, prompt_idx: int, delta: RequestDelta) -> None:
        now = time.monotonic()
        choice = self.choices[(prompt_idx, delta.index)]
        if delta.new_token_ids:
            if choice.last_token_time is None:
                choice.first_token_time = now
                self.metrics.observe("ttft", now - self.arrival_time)
            else:
                self.metrics.observe("itl", now - choice.last_token_time)
            choice.last_token_time = now
        choice.num_output_tokens = delta.num_output_tokens
        if delta.finished and delta.index == 0:  # the prompt's own lookup: a forked choice
            # shares its parent's prompt blocks, which is not a prefix-cache hit
            self.num_cached_prompt_tokens[prompt_idx] = delta.num_cached_prompt_tokens
        if delta.finished:
            self._finish(prompt_idx, choice, delta.finish_reason or "stop", now)
        if delta.timings is not None:
            self.metrics.observe_timings(delta.timings)

    def _finish(self, prompt_idx: int, choice: _ChoiceState, reason: str, now: float) -> None:
        choice.finish_reason = reason
        self.metrics.count_finished(reason)
        self.metrics.observe("e2e", now - self.arrival_time)
        self.metrics.observe("prompt_tokens", self.prompt_lengths[prompt_idx])
        self.metrics.observe("generation_tokens", choice.num_output_tokens)
        if choice.num_output_tokens > 1 and choice.first_token_time and choice.last_token_time:
            decode_time = choice.last_token_time - choice.first_token_time
            self.metrics.observe("tpot", decode_time / (choice.num_output_tokens - 1))

    def usage(self) -> UsageInfo:
        num_prompt_tokens = sum(self.prompt_lengths)
        num_completion_tokens = sum(choice.num_output_tokens for choice in self.choices.values())
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.num_cached_prompt_tokens)
            ),
        )

    def close(self, unfinished_reason: str | None) -> None:
        """Count choices that never finished (client gone: "abort"; failure: "error"; None: the
        engine refused the request, which then counts as no request at all); log once."""
        if self.is_closed:
            return
        self.is_closed = True
        now = time.monotonic()
        for (prompt_idx, _), choice in self.choices.items():
            if choice.finish_reason is None and unfinished_reason is not None:
                self._finish(prompt_idx, choice, unfinished_reason, now)
        usage = self.usage()
        reasons = sorted({choice.finish_reason or "rejected" for choice in self.choices.values()})
        logger.info(
            "request %s: prompt_tokens=%d completion_tokens=%d finish_reason=%s latency=%.3fs",
            self.request_id,
            usage.prompt_tokens,
            usage.completion_tokens,
            ",".join(reasons),
            now - self.arrival_time,
        )
