"""`Request`: one sequence being served (prompt, generated tokens, progress, status).

A sequence is one choice of one user request; it is keyed by its `sequence_id`
("<request id>#<choice index>", see the README's "Ids" section), never by the user's request id.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from pagedserve.configs import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # every status > PREEMPTED is finished
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)  # eq=False: identity semantics, hashable
class Request:
    """One sequence. Its block table lives in the BlockManager, keyed by `sequence_id`.

    `num_computed_tokens` counts tokens whose K/V are in the cache; it only ever advances for
    work the model actually did (scheduler.update_from_output), and drops to 0 on preemption.
    """

    sequence_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower is served first (vLLM's convention)
    parent_sequence_id: str | None = None  # n > 1: this choice forks from the parent's prompt
    # Prompt logprobs: whether this sequence computes them (an n > 1 child forked from its parent
    # reuses the parent's), and how many prompt tokens have theirs (the first, which has none,
    # included). Unlike num_computed_tokens it survives preemption, so no row is sent twice.
    needs_prompt_logprobs: bool = False
    num_prompt_logprob_tokens: int = 0
    lora: int = 0  # the number of the LoRA adapter's load it runs (engine/lora.py); 0: the base
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def has_prompt_logprobs_left(self) -> bool:
        return (
            self.needs_prompt_logprobs and self.num_prompt_logprob_tokens < self.num_prompt_tokens
        )

    @property
    def cache_salt(self) -> Hashable:
        """Mixed into every block hash of this request's prefix chain: only requests with the
        same salt share cached blocks (vLLM's cache_salt; None: the shared cache). A LoRA
        adapter's K/V differ from the base model's: the requests of one load of an adapter share
        only among themselves."""
        salt = self.sampling_params.cache_salt
        return salt if not self.lora else ("lora", self.lora, salt)

    @property
    def max_cached_tokens(self) -> int | None:
        """How much of the prompt may come from the prefix cache (None: all of it).

        A cached position has no logits, and position p's logits score prompt token p + 1: only
        positions whose row was already sent may be skipped.
        """
        if not self.has_prompt_logprobs_left:
            return None
        return max(self.num_prompt_logprob_tokens - 1, 0)

    def num_prompt_positions(self, num_new_tokens: int) -> int:
        """How many of the next `num_new_tokens` positions to compute are the prompt's."""
        start = self.num_computed_tokens
        return max(0, min(start + num_new_tokens, self.num_prompt_tokens) - start)

    def prompt_logprob_rows(self, start: int, end: int) -> range:
        """Rows of a step computing positions [start, end) that score prompt tokens still unsent.

        ```
        prompt   t0   t1   t2   t3   t4        row p scores token p + 1; t0 has no logprob
        sent    |<- 3 ->|                      num_prompt_logprob_tokens = 3 (t0, t1, t2)
        rows           [p2][p3]                positions 2 and 3 score t3 and t4
        ```
        """
        if not self.has_prompt_logprobs_left:
            return range(0)
        first_unsent = max(self.num_prompt_logprob_tokens - 1, 0)
        if start > first_unsent:  # a cached prefix would have to cover unsent rows
            raise RuntimeError(
                f"sequence {self.sequence_id}: positions [{start}, {end}) skip prompt logprobs "
                f"(sent {self.num_prompt_logprob_tokens})"
            )
        first = max(start, first_unsent)
        last = min(end, self.num_prompt_tokens - 1)
        return range(first - start, max(last, first) - start)

    def advance(self, num_new_tokens: int) -> None:
        """The model computed the next `num_new_tokens` positions (and scored their prompt rows)."""
        self.num_computed_tokens += num_new_tokens
        if self.needs_prompt_logprobs:  # the rows up to here (and the first token's null) are sent
            self.num_prompt_logprob_tokens = max(
                self.num_prompt_logprob_tokens,
                min(self.num_computed_tokens + 1, self.num_prompt_tokens),
            )

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """The status `token_id` (just appended) finishes this sequence with, if any."""
        params = self.sampling_params
        num_output = self.num_output_tokens
        if num_output >= params.min_tokens:
            if token_id == self.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stop_reason(self, matched_stop: str | None) -> int | str | None:
        """vLLM's `stop_reason` of a finished sequence: the stop string that ended its text
        (`matched_stop`, from the detokenizer) or the `stop_token_ids` entry that ended it; None
        when EOS, the length, a grammar or an abort did."""
        if self.status != RequestStatus.FINISHED_STOPPED:
            return None
        if matched_stop is not None:
            return matched_stop
        last = self.output_token_ids[-1] if self.output_token_ids else None
        eos = last == self.eos_token_id and not self.sampling_params.ignore_eos
        return last if last in self.sampling_params.stop_token_ids and not eos else None

    def append_run(
        self, token_ids: list[int], max_model_len: int
    ) -> tuple[list[int], RequestStatus | None]:
        """Append tokens one by one up to the first that finishes the sequence (a speculative
        step's accepted drafts, then its sampled token); returns those appended and the status."""
        for num_appended, token_id in enumerate(token_ids, start=1):
            self.append_output_token(token_id)
            status = self.check_stop(token_id, max_model_len)
            if status is not None:
                return token_ids[:num_appended], status
        return token_ids, None

    def drop_last_output_tokens(self, num_tokens: int) -> None:
        """Forget the last generated tokens (a speculative run cut short by a stop string)."""
        if num_tokens > 0:
            del self.output_token_ids[-num_tokens:], self.all_token_ids[-num_tokens:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)
