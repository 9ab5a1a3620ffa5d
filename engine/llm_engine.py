"""`LLMEngine`: the synchronous step loop (schedule -> execute -> sample -> update -> process).

Owns the scheduler, the block manager, the cache engine and the output processor; one thread
drives it, so the bookkeeping needs no locks. `n > 1` is served as n sequences: choice 0 runs the
prompt, the others fork its blocks (see the scheduler) and are reported under the same request id.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from types import ModuleType

import torch

from pagedserve.cache.attention import get_attention_backend
from pagedserve.cache.block_manager import BlockManager
from pagedserve.cache.cache_engine import CacheEngine
from pagedserve.configs import EngineConfig, SamplingParams
from pagedserve.engine.cpu_threads import fit_threads_to_cpus
from pagedserve.engine.heap_retention import retain_freed_heap_memory
from pagedserve.engine.inputs import RequestValidator, ValidatedRequest
from pagedserve.engine.memory import kv_cache_num_blocks, make_cache_spec, resolve_device
from pagedserve.engine.model_loader import LoadedModel, load_model
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.module_swap import cpu_kernel_or_none
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.outputs import EngineStats, RequestDelta
from pagedserve.engine.rejection_sampler import RejectionSampler
from pagedserve.engine.sampler import SampledBatch, Sampler, SamplingRow, takes_only_argmax
from pagedserve.engine.sampling_defaults import model_sampling_defaults
from pagedserve.engine.structured_outputs import Matcher, StructuredOutputManager
from pagedserve.scheduler import Request, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


def _prepare_cpu_host(device: torch.device) -> ModuleType | None:
    """On the CPU: threads capped at the CPUs this process may use (engine/cpu_threads.py), freed
    activation memory kept in the process (before the first forward pass allocates anything),
    and the C++ extension, whose argmax greedy rows take (engine/sampler.py). Elsewhere None."""
    if device.type != "cpu":
        return None
    fit_threads_to_cpus()
    retain_freed_heap_memory()
    return cpu_kernel_or_none("greedy sampling")


class LLMEngine:
    """Synchronous core: `add_request`, then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.model.device)
        cpu_kernel = _prepare_cpu_host(device)
        loaded = loaded or load_model(config.model, device)
        self.tokenizer = loaded.tokenizer
        self.model_name = config.model.served_model_names[0]
        self.vocab_size = loaded.hf_config.vocab_size
        self.max_model_len, self.classifier = loaded.max_model_len, loaded.classifier
        scheduler_config = config.scheduler.for_model_len(self.max_model_len)  # the step budget
        config = self.config = config.model_copy(update={"scheduler": scheduler_config})
        self.eos_token_ids = _eos_token_ids(loaded)
        spec = make_cache_spec(
            loaded.hf_config, loaded.model, config.cache.block_size, config.cache.kv_cache_dtype
        )
        num_blocks = kv_cache_num_blocks(config, spec, device, loaded.model, self.max_model_len)
        self.cache_engine = CacheEngine(spec, num_blocks, device)
        logger.info("%s", self.cache_engine.describe(self.max_model_len))
        self.block_manager = BlockManager(  # a step adds at most max_num_batched_tokens
            num_blocks, spec.block_size, config.cache.enable_prefix_caching, spec.sliding_windows
        )
        self.block_manager.max_step_tokens = config.scheduler.max_num_batched_tokens
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        backend = get_attention_backend(config.cache.attention_backend, device)
        logger.info("attention backend: %s", backend.name)
        self.runner = ModelRunner(loaded.model, self.cache_engine, backend, config.model)
        self.sampler = Sampler(config.model.seed, device, cpu_kernel)
        self.rejection_sampler = RejectionSampler(self.sampler, config.model.seed, device)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, device)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.validator = RequestValidator.for_engine(
            config, self.vocab_size, self.max_model_len, self.eos_token_ids, self.scheduler
        )
        self.num_steps = 0
        self.last_plan: SchedulerOutput | None = None  # the last non-empty step's, for its state
        self.step_token_counts: deque[int] = deque(maxlen=100_000)

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's defaults for the sampling fields a request leaves out (vLLM's)."""
        return model_sampling_defaults(self.runner.model, self.config.model)

    # ---- requests in -----------------------------------------------------------------------

    def validate_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ValidatedRequest:
        """Every check, once; safe on any thread. Raises InvalidRequestError (nothing queued)."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.runner.check_request(params)
        return self.validator.validate(request_id, prompt_token_ids, params, arrival_time, priority)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue; raises InvalidRequestError before queueing anything. A constraint
        is compiled here, on this thread (AsyncEngine compiles off the engine thread instead)."""
        validated = self.validate_request(
            request_id, prompt_token_ids, params, arrival_time, priority
        )
        if params.structured_outputs is not None:
            grammar = self.structured.compile(params.structured_outputs)
            validated = dataclasses.replace(validated, grammar=grammar)
        self.add_validated_request(validated)

    def add_validated_request(self, request: ValidatedRequest) -> None:
        """Queue one sequence per choice. Raises InvalidRequestError (nothing queued) only if the
        request id is in use or its LoRA adapter was unloaded since `validate_request`."""
        num_choices = request.params.n
        # The adapter's load now serving it (one unloaded since validation is refused here).
        lora = self.runner.lora.resolve(request.params.lora) if self.runner.lora else 0
        sequence_ids = [sequence_id(request.request_id, index) for index in range(num_choices)]
        sequences = [
            Request(
                sequence_ids[index],
                list(request.prompt_token_ids),
                request.params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                parent_sequence_id=sequence_ids[0] if index else None,
                needs_prompt_logprobs=request.params.prompt_logprobs is not None,
                lora=lora,
            )
            for index in range(num_choices)
        ]
        matchers: list[Matcher | None] = [None] * num_choices
        if request.params.structured_outputs is not None:
            if request.grammar is None:
                raise RuntimeError(f"request {request.request_id}: constrained but not compiled")
            matchers = list(self.structured.new_matchers(request.grammar, request.params))
        # Refuses an id in use, before queueing.
        self.outputs.add(request.request_id, sequences, matchers)
        for sequence in sequences:
            self.scheduler.add_request(sequence)

    def abort_request(self, request_id: str) -> list[RequestDelta]:
        """Finish every choice of `request_id` now, from any state; frees its blocks at once."""
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        rows, drafts = self.outputs.sampling_rows(plan), _drafts_per_row(plan)
        try:
            logits = self._forward(plan, rows, drafts)
        except Exception as error:  # noqa: BLE001 - fail this batch's requests, keep serving
            logger.exception("forward pass failed; failing %d sequences", len(plan.requests))
            return self.outputs.fail({s.sequence_id: error for s in plan.requests})
        sampled = self._sample(plan, rows, drafts, logits)
        deltas = self.outputs.fail(sampled.errors)  # before the update: they have no token
        updates = self.scheduler.update_from_output(plan, sampled.runner_output())
        deltas += self.outputs.process(updates, sampled.logprobs, sampled.draft_logprobs)
        return self.runner.hidden.attach(deltas)  # embeddings on their final deltas

    def _count_step(self, plan: SchedulerOutput) -> None:
        self.num_steps += 1
        self.last_plan = plan
        self.step_token_counts.append(plan.num_batched_tokens)

    def _forward(
        self, plan: SchedulerOutput, rows: list[SamplingRow], drafts: list[list[int]]
    ) -> torch.Tensor:
        """Logits [num sampling rows (drafts included) + num prompt-logprob rows, vocab_size];
        constrained sampling rows masked by their grammar, before any sampling (the
        logits-processor seam). Prompt rows are never masked: they score the prompt as is."""
        self._count_step(plan)
        logits = self.runner.execute(plan, {row.sequence_id for row in rows if row.params.embed})
        # One matcher per sampling row: a sequence's draft rows follow its first row, and only
        # unconstrained sequences draft (scheduler/speculation.py), so draft rows get None.
        matchers = [
            row_matcher
            for matcher, row_drafts in zip(self.outputs.matchers(rows), drafts, strict=True)
            for row_matcher in (matcher, *[None] * len(row_drafts))
        ]
        if not takes_only_argmax(rows, matchers, logits.shape[0]):
            logits = logits.float()
        self.structured.apply(logits[: len(matchers)], matchers)
        return logits

    def _sample(
        self,
        plan: SchedulerOutput,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        logits: torch.Tensor,
    ) -> SampledBatch:
        """Sample the first rows (each sampling sequence's own row, then its drafts' rows); the
        prompt rows after them score prompt logprobs (a failure there fails the sequences that
        asked, as a sampling failure does)."""
        num_sampling_rows = len(rows) + sum(len(row_drafts) for row_drafts in drafts)
        sampling_logits = logits[:num_sampling_rows]
        if any(drafts):  # speculation: 1 + len(drafts) rows per sampling sequence
            runs = self.rejection_sampler.verify(sampling_logits, rows, drafts)
            sampled = SampledBatch.split_runs(rows, runs)
        else:
            sampled = SampledBatch.split(rows, self.sampler.sample(sampling_logits, rows))
        sampled.errors.update(self.outputs.score_prompts(plan, logits[num_sampling_rows:]))
        for row, matcher in zip(
            rows, self.outputs.matchers(rows), strict=True
        ):  # grammars follow their tokens
            token_id = sampled.token_ids.get(row.sequence_id)
            if matcher is None or token_id is None:
                continue
            error = self.structured.follow(matcher, token_id)
            if error is not None:  # no token was allowed, or masking took too long
                del sampled.token_ids[row.sequence_id], sampled.logprobs[row.sequence_id]
                sampled.errors[row.sequence_id] = error
        return sampled

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
            num_prompt_tokens=self.outputs.num_prompt_tokens,
            num_prefilled_tokens=self.scheduler.num_prefilled_tokens,
            num_generation_tokens=self.outputs.num_generation_tokens,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_steps=self.num_steps,
            num_structured_requests=self.structured.num_constrained_requests,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, object]:
        speculator = self.scheduler.speculator
        if not speculator.enabled:
            return {}
        return {
            "spec_num_drafts": speculator.num_drafts,
            "spec_num_draft_tokens": speculator.num_draft_tokens,
            "spec_num_accepted_tokens": speculator.num_accepted_tokens,
            "spec_num_accepted_per_position": tuple(speculator.num_accepted_per_position),
        }


def _drafts_per_row(plan: SchedulerOutput) -> list[list[int]]:
    """Each sampling sequence's draft tokens (plan order, as its sampling row), often empty."""
    return [s.draft_token_ids for s in plan.requests if s.needs_sample]


def sequence_id(request_id: str, index: int) -> str:
    """The scheduler's id of choice `index` of `request_id`. Distinct requests never share one:
    the index after the last "#" gives back both parts."""
    return f"{request_id}#{index}"


def _eos_token_ids(loaded: LoadedModel) -> list[int]:
    """EOS ids from the generation config (may be several; the tokenizer's first), else the
    tokenizer's."""
    generation_config = getattr(loaded.model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    first = loaded.tokenizer.eos_token_id  # vLLM's EOS; the others end a choice as stop tokens
    return list(dict.fromkeys([first, *ids] if first in ids else ids))
