"""`OutputProcessor`: the engine's side of a step after the scheduler's update.

Owns the per-choice state (detokenizer, seeded generator, prompt logprobs) and the per-request
groups of choices (`n > 1`); turns each `RequestUpdate` into a `RequestDelta` (text, stop strings,
logprobs, timings; the prompt's logprobs on a choice's first delta). It never sets a sequence's
status: a stop string is reported to the scheduler (`Scheduler.stop_on_string`), which decides
how the sequence finishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.outputs import RequestDelta, RequestTimings, TokenLogprob
from pagedserve.engine.prompt_logprobs import PromptEntries, PromptLogprobs
from pagedserve.engine.sampler import NoTokenLeftError, SamplingRow
from pagedserve.engine.structured_outputs import GrammarError, Matcher
from pagedserve.scheduler import Request, RequestStatus, RequestUpdate, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceState:
    """One choice of a user request: the scheduler's sequence plus what only the engine keeps."""

    index: int  # the choice index, 0..n-1
    sequence: Request  # the scheduler's sequence serving this choice
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None  # set for seeded requests: seed + index
    group: RequestState
    matcher: Matcher | None = None  # a constrained choice's grammar state (its output tokens)
    has_sent_prompt_logprobs: bool = False


@dataclass(slots=True, eq=False)
class RequestState:
    """One user request: its `n` choices; dropped once the last of them has finished."""

    request_id: str
    choices: list[ChoiceState]
    num_finished: int = 0

    def timings(self) -> RequestTimings:
        """Earliest start over all choices: a forked choice is first scheduled only after its
        parent's prompt, so the last choice alone would misstate queue and prefill times."""
        sequences = [choice.sequence for choice in self.choices]
        return RequestTimings(
            sequences[0].arrival_time,
            _earliest(s.first_scheduled_time for s in sequences),
            _earliest(s.first_token_time for s in sequences),
            time.monotonic(),
        )


class OutputProcessor:
    """Per-request state of the engine, keyed by the user's request id (and, as an index into
    it, by each choice's sequence id)."""

    def __init__(self, tokenizer: object, scheduler: Scheduler, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.device = device
        self.requests: dict[str, RequestState] = {}  # the user's request id -> its state
        self._choices: dict[str, ChoiceState] = {}  # sequence id -> its choice (an index)
        self._prompt_logprobs = PromptLogprobs()
        self.num_prompt_tokens = 0  # prefilled: each choice's prompt, counted at its first token
        self.num_generation_tokens = 0

    def add(
        self,
        request_id: str,
        sequences: list[Request],
        matchers: list[Matcher | None] | None = None,
    ) -> None:
        """Start tracking a request whose choices are `sequences` (choice i is sequences[i]),
        each constrained by `matchers[i]` when given.

        Raises:
            InvalidRequestError: the request id is already in use (nothing is tracked then).
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        group = RequestState(request_id, [])
        for index, sequence in enumerate(sequences):
            params = sequence.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            detokenizer = IncrementalDetokenizer.for_sequence(self.tokenizer, sequence)
            matcher = matchers[index] if matchers else None
            choice = ChoiceState(index, sequence, detokenizer, generator, group, matcher)
            group.choices.append(choice)
            self._choices[sequence.sequence_id] = choice
        self.requests[request_id] = group

    def sampling_rows(self, plan: SchedulerOutput) -> list[SamplingRow]:
        """One row per sequence that samples this step, in plan order (the logits' row order)."""
        return [self._sampling_row(s.sequence_id) for s in plan.requests if s.needs_sample]

    def _sampling_row(self, sequence_id: str) -> SamplingRow:
        choice = self._choices[sequence_id]
        sequence, params = choice.sequence, choice.sequence.sampling_params
        banned: list[int] = []
        if sequence.num_output_tokens < params.min_tokens:
            banned = [t for t in (sequence.eos_token_id, *params.stop_token_ids) if t is not None]
        return SamplingRow(
            sequence_id,
            params,
            sequence.prompt_token_ids,
            sequence.output_token_ids,
            sequence.eos_token_id,
            choice.generator,
            banned,
        )

    def matchers(self, rows: list[SamplingRow]) -> list[Matcher | None]:
        """Each row's grammar matcher (None: unconstrained), in row order."""
        return [self._choices[row.sequence_id].matcher for row in rows]

    def score_prompts(self, plan: SchedulerOutput, logits: Tensor) -> dict[str, Exception]:
        """Prompt logprobs of this step's prompt rows (call before the scheduler's update).

        Returns:
            sequence id -> error for the sequences whose rows could not be scored.
        """
        try:
            self._prompt_logprobs.add_step(plan, logits, self.scheduler.requests)
        except Exception as error:  # noqa: BLE001 - fail the sequences that asked, keep serving
            return {s.sequence_id: error for s in plan.requests if s.prompt_logprob_rows}
        return {}

    # ---- after the scheduler's update ------------------------------------------------------

    def process(
        self,
        updates: list[RequestUpdate],
        logprobs: dict[str, TokenLogprob | None],
        draft_logprobs: dict[str, list[TokenLogprob | None]] | None = None,
    ) -> list[RequestDelta]:
        """One delta per update: new text (held back at a possible stop string), and for a
        finished choice its final delta. `draft_logprobs`: those of a speculative step's
        accepted drafts, which precede the sampled token's. An update without a token
        (max_tokens 0: the request ended after its prompt) has no logprob."""
        deltas = []
        for update in updates:
            sequence_id = update.sequence_id
            run = [*(draft_logprobs or {}).get(sequence_id, []), logprobs.get(sequence_id)]
            deltas.append(self._process_update(update, run))
            self.num_generation_tokens += len(deltas[-1].new_token_ids)
        return deltas

    def _process_update(
        self, update: RequestUpdate, run_logprobs: list[TokenLogprob | None]
    ) -> RequestDelta:
        choice = self._choices[update.sequence_id]
        sequence = choice.sequence
        if sequence.num_output_tokens == len(update.new_token_ids):  # its first token: the
            self.num_prompt_tokens += sequence.num_prompt_tokens  # prompt has been prefilled
        text, stop_string_hit, num_after_stop = _detokenize(choice, update.new_token_ids)
        # The grammar took its stop token (also under ignore_eos): the structure is complete.
        grammar_done = choice.matcher is not None and bool(choice.matcher.is_terminated())
        if not stop_string_hit and (update.status.is_finished or grammar_done):
            tail, stop_string_hit = choice.detokenizer.flush()
            text += tail
        if stop_string_hit or grammar_done:  # either ends the text: finished as stopped
            self.scheduler.stop_on_string(sequence, num_after_stop)
        token_ids = tuple(update.new_token_ids[: len(update.new_token_ids) - num_after_stop])
        kept = [logprob for logprob in run_logprobs[: len(token_ids)] if logprob is not None]
        logprobs = tuple(kept) if kept else None
        if sequence.is_finished:
            return self._final_delta(choice, token_ids, text, logprobs)
        return RequestDelta(
            choice.group.request_id,
            choice.index,
            token_ids,
            text,
            logprobs,
            sequence.num_prompt_tokens,
            sequence.num_output_tokens,
            prompt_logprobs=self._take_prompt_logprobs(choice),
        )

    def _take_prompt_logprobs(self, choice: ChoiceState) -> PromptEntries | None:
        """The prompt's entries for this choice's first delta once they are all computed: its
        own, or (a forked n > 1 choice) its parent's."""
        sequence = choice.sequence
        if sequence.sampling_params.prompt_logprobs is None or choice.has_sent_prompt_logprobs:
            return None
        source = (
            sequence.sequence_id if sequence.needs_prompt_logprobs else sequence.parent_sequence_id
        )
        entries = self._prompt_logprobs.get(source or "", sequence.num_prompt_tokens)
        choice.has_sent_prompt_logprobs = entries is not None
        if entries is not None and len(choice.group.choices) == 1:
            self._prompt_logprobs.discard(sequence.sequence_id)  # nobody else needs them
        return entries

    # ---- finishing outside the token flow --------------------------------------------------

    def abort(self, request_id: str) -> list[RequestDelta]:
        """Finish every unfinished choice of `request_id` now, from any state."""
        group = self.requests.get(request_id)
        if group is None:
            return []
        sequence_ids = [choice.sequence.sequence_id for choice in group.choices]
        return self._finish(sequence_ids, RequestStatus.FINISHED_ABORTED, None)

    def fail(self, errors: dict[str, Exception]) -> list[RequestDelta]:
        """Fail each sequence in `errors` (sequence id -> what went wrong); the others go on."""
        deltas = []
        for sequence_id, error in errors.items():
            logger.error("sequence %s failed: %r", sequence_id, error)
            message = (
                str(error)
                if isinstance(error, (GrammarError, NoTokenLeftError))
                else f"internal error: {type(error).__name__}"
            )
            deltas += self._finish([sequence_id], RequestStatus.FINISHED_ERROR, message)
        return deltas

    def _finish(
        self, sequence_ids: list[str], status: RequestStatus, error: str | None
    ) -> list[RequestDelta]:
        deltas = []
        for sequence_id in sequence_ids:
            if self.scheduler.finish_request(sequence_id, status) is not None:
                deltas.append(self._final_delta(self._choices[sequence_id], (), "", error=error))
        return deltas

    def _final_delta(
        self,
        choice: ChoiceState,
        new_token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprob, ...] | None = None,
        error: str | None = None,
    ) -> RequestDelta:
        sequence, group = choice.sequence, choice.group
        prompt_logprobs = self._take_prompt_logprobs(choice)
        del self._choices[sequence.sequence_id]
        group.num_finished += 1
        timings = None
        if group.num_finished == len(group.choices):  # the request's last choice
            del self.requests[group.request_id]
            timings = group.timings()
            for member in group.choices:
                self._prompt_logprobs.discard(member.sequence.sequence_id)
        return RequestDelta(
            group.request_id,
            choice.index,
            new_token_ids,
            text,
            logprobs,
            sequence.num_prompt_tokens,
            sequence.num_output_tokens,
            finished=True,
            finish_reason=sequence.status.finish_reason,
            stop_reason=sequence.stop_reason(choice.detokenizer.matched_stop),
            error=error,
            num_cached_prompt_tokens=sequence.num_cached_tokens,
            timings=timings,
            prompt_logprobs=prompt_logprobs,
        )


def _detokenize(choice: ChoiceState, token_ids: list[int]) -> tuple[str, bool, int]:
    """(text, stop string hit, tokens after the one that completed it). A speculative step's
    several tokens are fed one by one, so a stop string ends the run where it completed."""
    if len(token_ids) == 1:
        return (*choice.detokenizer.add(token_ids), 0)
    text = ""
    for index, token_id in enumerate(token_ids):
        piece, hit = choice.detokenizer.add([token_id])
        text += piece
        if hit:
            return text, True, len(token_ids) - index - 1
    return text, False, 0


def _earliest(times: Iterable[float | None]) -> float | None:
    return min((t for t in times if t is not None), default=None)
