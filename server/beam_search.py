"""Beam search (vLLM's `use_beam_search`), on top of the engine rather than inside it, as vLLM's
server does it: each step asks the engine for one token of every live beam, with the 2 x width
most likely next tokens and their logprobs. Every extension by an end-of-sequence token is set
aside as a finished beam; of the others, the width best by cumulative logprob become the next
beams. After `max_tokens` steps the finished and live beams are ranked by cumulative logprob /
length^length_penalty, the length counting the prompt as vLLM's does (the EOS not counted), and
the best `width` returned, one choice each, best first.

Each step's requests share the prompt's blocks through the prefix cache, so a step recomputes
only the tail past the last whole block of each beam. The beams arrive together at the end, one
finished delta each (streamed, in one burst: a beam that leads now may be dropped later). A step
whose requests fail cancels the others; one aborted (the server shutting down) ends the search
with the beams so far, `finish_reason` "abort".
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.configs import SamplingParams, StructuredOutputs
from pagedserve.engine.client import EngineClient
from pagedserve.engine.errors import RequestFailedError
from pagedserve.engine.outputs import RequestDelta, TokenLogprob
from pagedserve.server.errors import invalid_request

MAX_BEAM_WIDTH = 10  # 2 x width alternatives a step: the engine returns at most 20


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the EOS token in the text
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter the request names (engine/lora.py)


@dataclass(slots=True)
class Beam:
    token_ids: list[int] = field(default_factory=list)  # generated, an EOS last if finished
    cum_logprob: float = 0.0
    finished: bool = False

    def rank(self, num_prompt_tokens: int, length_penalty: float) -> float:
        """Orders beams as cum_logprob / length^length_penalty does (higher is better), in log
        space so that no length_penalty overflows: logprobs are <= 0, so the score is
        -exp(log(-cum_logprob) - length_penalty x log(length))."""
        if self.cum_logprob >= 0.0:  # logprobs are <= 0: only a certain beam, the best
            return math.inf
        length = num_prompt_tokens + len(self.token_ids) - (1 if self.finished else 0)
        return length_penalty * math.log(max(length, 1)) - math.log(-self.cum_logprob)


async def beam_search(
    engine: EngineClient,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    priority: int = 0,
) -> AsyncIterator[RequestDelta]:
    """Run the search; yield one finished delta per returned beam (choice index = rank)."""
    step_params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        logprobs=2 * params.width,
        cache_salt=params.cache_salt,
        lora=params.lora,
    )
    live, finished, reason = [Beam()], [], "length"
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    for step in range(params.max_tokens):
        entries = await _step(
            engine,
            [prompt_token_ids + beam.token_ids for beam in live],
            step_params,
            f"{request_id}-beam-{step}",
            priority,
        )
        if entries is None:
            reason = "abort"
            break
        candidates = []
        for beam, entry in zip(live, entries, strict=True):
            for token_id, logprob in entry.top_logprobs:
                extended = Beam(beam.token_ids + [token_id], beam.cum_logprob + logprob)
                extended.finished = token_id in eos
                (finished if extended.finished else candidates).append(extended)
        live = sorted(candidates, key=lambda beam: beam.cum_logprob, reverse=True)[: params.width]
        if not live:
            break
    ranked = sorted(
        finished + live,
        key=lambda beam: beam.rank(len(prompt_token_ids), params.length_penalty),
        reverse=True,
    )[: params.width]
    if len(ranked) < params.width and reason != "abort":  # a vocabulary under 2 x width
        raise RequestFailedError(f"beam search found {len(ranked)} beams, fewer than n")
    for index, beam in enumerate(ranked):
        yield _finished_delta(
            engine.tokenizer, request_id, index, beam, prompt_token_ids, params, reason
        )
    for index in range(len(ranked), params.width):  # aborted before there were n beams
        yield _finished_delta(
            engine.tokenizer, request_id, index, Beam(), prompt_token_ids, params, reason
        )


async def _step(
    engine: EngineClient,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    priority: int,
) -> list[TokenLogprob] | None:
    """One token's logprobs for each prompt, all queued at once (the engine batches them); None
    if the engine aborted one. If one fails, the others are cancelled (their requests aborted)
    before the failure is raised."""
    tasks = [
        asyncio.ensure_future(
            _next_token_logprobs(engine, prompt, params, f"{request_id}-{i}", priority)
        )
        for i, prompt in enumerate(prompts)
    ]
    try:
        entries = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return None if any(entry is None for entry in entries) else list(entries)


async def _next_token_logprobs(
    engine: EngineClient,
    token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    priority: int,
) -> TokenLogprob | None:
    entry = None
    async for delta in engine.generate(token_ids, params, request_id, priority):
        if delta.finish_reason == "error":
            raise RequestFailedError(f"beam search step failed: {delta.error or 'no reason'}")
        if delta.finish_reason == "abort":
            return None
        if delta.new_logprobs:
            entry = delta.new_logprobs[0]
    if entry is None:
        raise RequestFailedError(f"the engine returned no logprobs for {request_id}")
    return entry


def _finished_delta(
    tokenizer: Any,
    request_id: str,
    index: int,
    beam: Beam,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    unfinished_reason: str,
) -> RequestDelta:
    # As vLLM's: a finished beam's EOS is in neither its text nor its token ids (nor its usage)
    # unless include_stop_str_in_output.
    token_ids = beam.token_ids
    if beam.finished and not params.include_stop_str_in_output:
        token_ids = token_ids[:-1]
    text = tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
    return RequestDelta(
        request_id,
        index,
        tuple(token_ids),
        text,
        None,
        len(prompt_token_ids),
        len(token_ids),
        finished=True,
        finish_reason="stop" if beam.finished else unfinished_reason,
    )


# Fields that shape sampling, which a beam search does not do: asked for, they are a 400 rather
# than dropped. The search ranks by the model's own logprobs, which is what temperature 0 or 1,
# top_p 1, top_k 0/-1 and min_p 0 ask for (vLLM accepts any value and ignores it); a seed asks
# for a repeatable answer, which an exact search gives.
_NOT_WITH_BEAMS = {
    "temperature": lambda body: body.temperature not in (None, 0, 1),
    "top_p": lambda body: body.top_p not in (None, 1),
    "top_k": lambda body: body.top_k not in (None, 0, -1),
    "min_p": lambda body: body.min_p not in (None, 0),
    "logprobs": lambda body: body.logprobs is not None and body.logprobs is not False,
    "prompt_logprobs": lambda body: body.prompt_logprobs is not None,
    "stop": lambda body: bool(body.stop),
    "stop_token_ids": lambda body: bool(body.stop_token_ids),
    "stop_regex": lambda body: bool(body.stop_regex),
    "min_tokens": lambda body: body.min_tokens > 0,
    "logit_bias": lambda body: bool(body.logit_bias),
    "bad_words": lambda body: bool(body.bad_words),
    "allowed_token_ids": lambda body: body.allowed_token_ids is not None,
    "presence_penalty": lambda body: body.presence_penalty not in (None, 0),
    "frequency_penalty": lambda body: body.frequency_penalty not in (None, 0),
    "repetition_penalty": lambda body: body.repetition_penalty not in (None, 1),
}


def beam_search_params(
    body: Any,
    max_tokens: int,
    structured_outputs: StructuredOutputs | None,
    lora: str | None = None,
    max_logprobs: int = -1,
) -> BeamSearchParams | None:
    """The request's beam search (None without `use_beam_search`); raises a 400 naming the
    field for one that beam search would not honour (an output constraint among them)."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise invalid_request(
                "length_penalty applies to use_beam_search only.", "length_penalty"
            )
        return None
    if max_tokens < 1:
        raise invalid_request("use_beam_search needs max_tokens of at least 1.", "max_tokens")
    if structured_outputs is not None:
        param = structured_outputs.param
        raise invalid_request(f"{param} is not supported with use_beam_search.", param)
    for name, asks in _NOT_WITH_BEAMS.items():
        if asks(body):
            raise invalid_request(f"{name} is not supported with use_beam_search.", name)
    width = body.n if body.n is not None else 1
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise invalid_request(
            f"n is the beam width with use_beam_search: 1 to {MAX_BEAM_WIDTH}, got {width}.", "n"
        )
    if not math.isfinite(body.length_penalty):
        raise invalid_request("length_penalty must be a finite number.", "length_penalty")
    if max_logprobs != -1 and 2 * width > max_logprobs:  # each step scores 2 x width candidates
        raise invalid_request(
            f"use_beam_search with n={width} needs {2 * width} alternatives per token, more than "
            f"the server returns ({max_logprobs}, --max-logprobs).",
            "n",
        )
    return BeamSearchParams(
        width,
        max_tokens,
        body.length_penalty,
        body.ignore_eos,
        body.include_stop_str_in_output,
        body.skip_special_tokens,
        body.cache_salt,
        lora,
    )
