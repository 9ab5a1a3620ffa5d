"""`LLMEngine`: the synchronous step loop (schedule -> prepare/forward -> sample -> update).

Owns the scheduler, the block manager and the cache engine; one thread drives it, so the
bookkeeping needs no locks. `n > 1` is served as n sequences: choice 0 runs the prompt, the
others fork its blocks (see the scheduler) and are reported under the same request id.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from pagedserve.cache.attention import get_attention_backend
from pagedserve.cache.block_manager import BlockManager
from pagedserve.cache.cache_engine import CacheEngine
from pagedserve.configs import EngineConfig, SamplingParams
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.memory import kv_cache_num_blocks, make_cache_spec, resolve_device
from pagedserve.engine.model_loader import LoadedModel, load_model
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.outputs import EngineStats, RequestDelta, RequestTimings, TokenLogprob
from pagedserve.engine.sampler import Sampler, SampleResult, SamplingRow
from pagedserve.scheduler import (
    AdmissionError,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Choice:
    """Engine-side state of one sequence (one choice of a request)."""

    request_id: str  # the user's request id (shared by all choices)
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None


class LLMEngine:
    """Synchronous core: `add_request`, then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.model.device)
        loaded = loaded or load_model(config.model, device)
        self.tokenizer = loaded.tokenizer
        self.model_name = config.model.served_model_name or config.model.model
        self.vocab_size = loaded.hf_config.vocab_size
        self.max_model_len = _cap_to_sliding_window(loaded.max_model_len, loaded.hf_config)
        self.eos_token_ids = _eos_token_ids(loaded)
        spec = make_cache_spec(
            loaded.hf_config, loaded.model, config.cache.block_size, config.cache.kv_cache_dtype
        )
        num_blocks = kv_cache_num_blocks(config, spec, device, loaded.model)
        self.cache_engine = CacheEngine(spec, num_blocks, device)
        logger.info("%s", self.cache_engine.describe(self.max_model_len))
        self.block_manager = BlockManager(
            num_blocks, spec.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        backend = get_attention_backend(config.cache.attention_backend, device)
        logger.info("attention backend: %s", backend.name)
        self.runner = ModelRunner(loaded.model, self.cache_engine, backend)
        self.sampler = Sampler(config.model.seed, device)
        self._choices: dict[str, _Choice] = {}  # sequence id -> state
        self._groups: dict[str, list[str]] = {}  # request id -> its sequence ids
        # request id -> earliest (first scheduled, first token) time over its finished choices: a
        # forked choice is first scheduled only after its parent's prompt, so the last choice to
        # finish alone would misstate the request's queue and prefill times.
        self._group_starts: dict[str, tuple[float | None, float | None]] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.step_token_counts: deque[int] = deque(maxlen=100_000)

    # ---- requests in -----------------------------------------------------------------------

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if this request could never be served (nothing queued)."""
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", "prompt"
            )
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise InvalidRequestError(
                f"logit_bias token ids must be < {self.vocab_size}", "logit_bias"
            )
        # They index the logits (banned while min_tokens is unmet): out of range would fail a step.
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be < {self.vocab_size}", "stop_token_ids"
            )
        num_prompt = len(prompt_token_ids)
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt + params.max_tokens} were requested ({num_prompt} in the prompt, "
                f"{params.max_tokens} for the completion)",
                "max_tokens" if num_prompt < self.max_model_len else "prompt",
            )
        try:
            self.scheduler.check_admissible(num_prompt, params.max_tokens)
        except AdmissionError as error:
            raise InvalidRequestError(str(error), error.param) from None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue; raises InvalidRequestError before queueing anything."""
        sequence_ids = (
            [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        )
        # Choice ids of an n > 1 request ("a#1") may equal another request's id: checked up front,
        # so that no choice is ever queued without its group.
        if request_id in self._groups or any(sid in self._choices for sid in sequence_ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.validate_request(prompt_token_ids, params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        eos, extra_stop_ids = self._eos_for(params)
        if extra_stop_ids:
            params = dataclasses.replace(
                params, stop_token_ids=params.stop_token_ids + extra_stop_ids
            )
        for index, sequence_id in enumerate(sequence_ids):
            request = Request(
                sequence_id,
                list(prompt_token_ids),
                params,
                eos_token_id=eos,
                arrival_time=arrival_time,
                priority=priority,
                parent_request_id=sequence_ids[0] if index else None,
            )
            self.scheduler.add_request(request)
            generator = (
                None
                if params.seed is None
                else torch.Generator(device=self.cache_engine.device).manual_seed(
                    params.seed + index
                )
            )
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output
            )
            self._choices[sequence_id] = _Choice(request_id, index, request, detokenizer, generator)
        self._groups[request_id] = sequence_ids

    def _eos_for(self, params: SamplingParams) -> tuple[int | None, tuple[int, ...]]:
        if params.ignore_eos or not self.eos_token_ids:
            return None, ()
        return self.eos_token_ids[0], tuple(self.eos_token_ids[1:])

    def abort_request(self, request_id: str, reason: str = "abort") -> list[RequestDelta]:
        """Finish every choice of `request_id` now, from any state; frees its blocks at once."""
        status = (
            RequestStatus.FINISHED_ABORTED if reason == "abort" else RequestStatus.FINISHED_ERROR
        )
        deltas = []
        for sequence_id in list(self._groups.get(request_id, ())):
            request = self.scheduler.finish_request(sequence_id, status)
            if request is not None:
                deltas.append(
                    self._final_delta(request, (), "", error=None if reason == "abort" else reason)
                )
        return deltas

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        self.num_steps += 1
        self.step_token_counts.append(plan.num_batched_tokens)
        try:
            logits = self.runner.execute(plan)
        except Exception as error:  # noqa: BLE001 - fail this batch's requests, keep serving
            logger.exception("forward pass failed; failing %d requests", len(plan.requests))
            return self._fail([s.request_id for s in plan.requests], error)
        rows = [self._sampling_row(s.request_id) for s in plan.requests if s.needs_sample]
        results = self.sampler.sample(logits, rows)
        sampled: dict[str, SampleResult] = {}
        failed: list[tuple[str, Exception]] = []
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, Exception):
                failed.append((row.request_id, result))
            else:
                sampled[row.request_id] = result
        deltas = [d for sid, error in failed for d in self._fail([sid], error)]
        updates = self.scheduler.update_from_output(
            plan, ModelRunnerOutput({sid: r.token_id for sid, r in sampled.items()})
        )
        self.num_generation_tokens += len(updates)
        for update in updates:
            request = self._choices[update.request_id].request
            if request.num_output_tokens == len(update.new_token_ids):  # its first token: the
                self.num_prompt_tokens += request.num_prompt_tokens  # prompt was prefilled
            deltas.append(
                self._delta(
                    update.request_id,
                    update.new_token_ids,
                    update.status,
                    sampled[update.request_id].logprob,
                )
            )
        return deltas

    def _sampling_row(self, sequence_id: str) -> SamplingRow:
        choice = self._choices[sequence_id]
        request, params = choice.request, choice.request.sampling_params
        banned: list[int] = []
        if request.num_output_tokens < params.min_tokens:
            banned = [t for t in (request.eos_token_id, *params.stop_token_ids) if t is not None]
        return SamplingRow(
            sequence_id,
            params,
            request.prompt_token_ids,
            request.output_token_ids,
            request.eos_token_id,
            choice.generator,
            banned,
        )

    def _fail(self, sequence_ids: list[str], error: Exception) -> list[RequestDelta]:
        deltas = []
        for sequence_id in sequence_ids:
            request = self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                logger.error("request %s failed: %r", sequence_id, error)
                deltas.append(
                    self._final_delta(
                        request, (), "", error=f"internal error: {type(error).__name__}"
                    )
                )
        return deltas

    def _delta(
        self,
        sequence_id: str,
        new_token_ids: list[int],
        status: RequestStatus,
        logprob: TokenLogprob | None,
    ) -> RequestDelta:
        choice = self._choices[sequence_id]
        text, stop_string_hit = choice.detokenizer.add(new_token_ids)
        logprobs = (logprob,) if logprob is not None else None
        if stop_string_hit and not status.is_finished:
            self.scheduler.finish_request(sequence_id, RequestStatus.FINISHED_STOPPED)
            status = RequestStatus.FINISHED_STOPPED
        request = choice.request
        if not status.is_finished:
            return RequestDelta(
                choice.request_id,
                choice.index,
                tuple(new_token_ids),
                text,
                logprobs,
                request.num_prompt_tokens,
                request.num_output_tokens,
            )
        if not stop_string_hit:
            tail, stop_string_hit = choice.detokenizer.flush()
            text += tail
        if stop_string_hit and status == RequestStatus.FINISHED_LENGTH:
            # The stop string completed on the last allowed token: it ended the text, so "stop".
            request.status = RequestStatus.FINISHED_STOPPED
        return self._final_delta(request, tuple(new_token_ids), text, logprobs=logprobs)

    def _final_delta(
        self,
        request: Request,
        new_token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprob, ...] | None = None,
        error: str | None = None,
    ) -> RequestDelta:
        choice = self._choices.pop(request.request_id)
        group = self._groups[choice.request_id]
        scheduled, first_token = self._group_starts.get(choice.request_id, (None, None))
        starts = (
            _earliest(scheduled, request.first_scheduled_time),
            _earliest(first_token, request.first_token_time),
        )
        self._group_starts[choice.request_id] = starts
        timings = None
        if all(sid not in self._choices for sid in group):  # the request's last choice
            del self._groups[choice.request_id], self._group_starts[choice.request_id]
            timings = RequestTimings(request.arrival_time, *starts, time.monotonic())
        return RequestDelta(
            choice.request_id,
            choice.index,
            new_token_ids,
            text,
            logprobs,
            request.num_prompt_tokens,
            request.num_output_tokens,
            finished=True,
            finish_reason=request.status.finish_reason,
            error=error,
            num_cached_prompt_tokens=max(request.num_cached_tokens, 0),
            timings=timings,
        )

    # ---- observability ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.block_manager.pool
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks,
            block_size=self.block_manager.block_size,
            cache_dtype=self.cache_engine.spec.dtype,
            kv_cache_usage=pool.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_steps=self.num_steps,
        )


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _cap_to_sliding_window(max_model_len: int, hf_config: object) -> int:
    """Our kernels attend over the whole context: beyond a sliding window that would be wrong,
    so such models serve at most `sliding_window` tokens, where both definitions agree."""
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < max_model_len:
        logger.warning(
            "capping max_model_len %d to the model's sliding window %d", max_model_len, window
        )
        return int(window)
    return max_model_len


def _eos_token_ids(loaded: LoadedModel) -> list[int]:
    """EOS ids from the generation config (may be several), else the tokenizer's."""
    generation_config = getattr(loaded.model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return list(dict.fromkeys(ids))
