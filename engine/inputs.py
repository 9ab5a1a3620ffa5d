"""Requests in: every check a request must pass, run once, before anything is queued.

`RequestValidator` reads only limits fixed at start (vocabulary, context length, pool size,
scheduling policy), so `AsyncEngine` runs it on the caller's thread and the engine thread
queues the resulting `ValidatedRequest` without checking it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import xgrammar

from pagedserve.configs import EngineConfig, SamplingParams
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.scheduler import AdmissionError, Scheduler


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """A request that passed `RequestValidator.validate`: what `LLMEngine.add_validated_request`
    queues. `params.stop_token_ids` already holds the model's extra EOS ids."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int
    # A constrained request's compiled constraint, once compiled (AsyncEngine: off-thread).
    grammar: xgrammar.CompiledGrammar | None = None


@dataclass(frozen=True, slots=True)
class RequestValidator:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]  # from the generation config; the first one is the EOS
    allows_priority: bool  # the priority scheduling policy is on
    check_admissible: Callable[[int, int], None]  # the scheduler's; raises AdmissionError
    max_logprobs: int = 20  # alternatives a request may ask for per token (-1: the vocabulary)

    @classmethod
    def for_engine(
        cls,
        config: EngineConfig,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: list[int],
        scheduler: Scheduler,
    ) -> RequestValidator:
        """The validator of an engine with these settings, vocabulary, context and scheduler."""
        allows_priority = config.scheduler.scheduling_policy == "priority"
        return cls(
            vocab_size,
            max_model_len,
            tuple(eos_token_ids),
            allows_priority,
            scheduler.check_admissible,
            config.model.max_logprobs,
        )

    def validate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
    ) -> ValidatedRequest:
        """Raises InvalidRequestError if this request could never be served (nothing queued)."""
        self._check_token_ids(prompt_token_ids, params)
        self._check_length(len(prompt_token_ids), params.max_tokens)
        self._check_logprobs(params)
        if priority != 0 and not self.allows_priority:
            raise InvalidRequestError(
                "priority needs the server's --scheduling-policy priority", "priority"
            )
        eos_token_id = None
        if not params.ignore_eos and self.eos_token_ids:
            eos_token_id, *extra_stop_ids = self.eos_token_ids
            if extra_stop_ids:
                stop_token_ids = params.stop_token_ids + tuple(extra_stop_ids)
                params = dataclasses.replace(params, stop_token_ids=stop_token_ids)
        prompt = list(prompt_token_ids)
        return ValidatedRequest(request_id, prompt, params, eos_token_id, arrival_time, priority)

    def _check_token_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab_size = self.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        if any(t >= vocab_size for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be < {vocab_size}", "logit_bias")
        # They index the logits (banned while min_tokens is unmet): out of range would fail a step.
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be < {vocab_size}", "stop_token_ids")
        if any(t >= vocab_size for word in params.bad_words_token_ids for t in word):
            raise InvalidRequestError(f"bad_words token ids must be < {vocab_size}", "bad_words")
        banned = {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if params.allowed_token_ids is not None and banned.issuperset(params.allowed_token_ids):
            raise InvalidRequestError("bad_words ban every one of allowed_token_ids", "bad_words")
        if any(t >= vocab_size for t in params.allowed_token_ids or ()):
            raise InvalidRequestError(
                f"allowed_token_ids must be < {vocab_size}", "allowed_token_ids"
            )
        constraint = params.structured_outputs
        if constraint is not None and constraint.think is not None:
            think = constraint.think
            if max(think.open_token_id, think.close_token_id) >= vocab_size:
                raise InvalidRequestError(
                    f"a think block's tags must be token ids < {vocab_size}", constraint.param
                )

    def _check_logprobs(self, params: SamplingParams) -> None:
        cap = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > cap:
                raise InvalidRequestError(
                    f"{name}: {wanted} alternatives per token requested, more than the server "
                    f"returns ({cap}, --max-logprobs)",
                    name,
                )

    def _check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion)",
                "max_tokens" if num_prompt_tokens < self.max_model_len else "prompt",
            )
        try:
            self.check_admissible(num_prompt_tokens, max_tokens)
        except AdmissionError as error:
            raise InvalidRequestError(str(error), error.param) from None
