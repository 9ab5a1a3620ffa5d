"""POST /generate: SGLang's native generation API (what SGLang's own clients, its benchmarks and
sglang-router's workers speak), on the same engine path as the OpenAI routes.

A request is one prompt or a batch; each prompt is one engine request with `n` choices (SGLang
fans `n` out into separate requests: here they share the prompt's blocks). The answer is SGLang's:
one `{"text", "output_ids", "meta_info"}` object for a single prompt with n 1, else a list in
prompt-major order (prompt i's choice j at i * n + j); streamed, every chunk carries the whole
answer so far (SGLang's default, cumulative), with `index` when there are several, then
`data: [DONE]`. Logprobs are SGLang's `[logprob, token_id, text or null]` triples.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.configs import SamplingParamsError
from pagedserve.engine.outputs import RequestDelta, TokenLogprob
from pagedserve.server.errors import APIError, invalid_request
from pagedserve.server.generate_protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerateRequest,
    GenerateSamplingParams,
    sampling_param,
)
from pagedserve.server.generation import EngineInput, Item, start_generation
from pagedserve.server.logprobs import check_logprobs_cap
from pagedserve.server.prompts import (
    Prompt,
    check_model,
    completion_prompts,
    parse_logit_bias,
    resolve_max_tokens,
)
from pagedserve.server.protocol import finite_logprob
from pagedserve.server.recorder import RequestRecorder
from pagedserve.server.streams import EventStreamResponse, sse_events

router = APIRouter()
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
# The engine's names for SGLang's fields, in the errors SamplingParams raises.
_SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
}
_TOP_LEVEL = {  # request fields, not sampling ones
    "cache_salt": "cache_salt",
    "lora": "lora_path",
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
}


@dataclass(slots=True)
class _Logprobs:
    """One choice's logprob lists: prompt positions from `start`, `num_top` alternatives."""

    start: int
    num_top: int
    tokenizer: Any  # None: no text in the triples (return_text_in_logprobs false)
    input_token: list[Any] = field(default_factory=list)
    input_top: list[Any] = field(default_factory=list)
    output_token: list[Any] = field(default_factory=list)
    output_top: list[Any] = field(default_factory=list)

    def _triple(self, logprob: float | None, token_id: int) -> list[Any]:
        text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
        # -inf (a masked token) is no JSON number: the OpenAI routes' floor
        return [None if logprob is None else finite_logprob(logprob), token_id, text]

    def _top(self, entry: TokenLogprob) -> list[Any]:
        return [self._triple(value, token_id) for token_id, value in entry.top_logprobs]

    def add_prompt(self, prompt_token_ids: list[int], entries: tuple[Any, ...]) -> None:
        # As SGLang: the first position returned has no logprob, wherever the list starts.
        for position in range(self.start, len(prompt_token_ids)):
            entry = entries[position] if position > self.start else None
            token_id = prompt_token_ids[position]
            self.input_token.append(self._triple(entry and entry.logprob, token_id))
            self.input_top.append(self._top(entry) if entry is not None else None)

    def add_output(self, entries: tuple[TokenLogprob, ...]) -> None:
        for entry in entries:
            self.output_token.append(self._triple(entry.logprob, entry.token_id))
            self.output_top.append(self._top(entry))

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_token_logprobs": self.input_token,
            "output_token_logprobs": self.output_token,
            "output_token_logprobs_length": len(self.output_token),
        }
        if self.num_top > 0:
            body.update(input_top_logprobs=self.input_top, output_top_logprobs=self.output_top)
        return body


@dataclass(slots=True)
class _Output:
    """One choice's answer as it grows (SGLang's item)."""

    id: str
    prompt_token_ids: list[int]
    logprobs: _Logprobs | None
    stream_interval: int = 1
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    e2e_latency: float | None = None
    num_sent_tokens: int = 0  # output tokens in the last chunk streamed

    def add(self, delta: RequestDelta, arrival_time: float) -> None:
        self.text += delta.new_text
        self.output_ids += delta.new_token_ids
        if self.logprobs is not None:
            if delta.prompt_logprobs is not None:
                self.logprobs.add_prompt(self.prompt_token_ids, delta.prompt_logprobs)
            self.logprobs.add_output(delta.new_logprobs or ())
        if delta.finished:
            self.finish_reason = _finish_reason(delta, self.output_ids)
            self.cached_tokens = delta.num_cached_prompt_tokens
            self.e2e_latency = time.monotonic() - arrival_time

    def due(self) -> bool:
        """Whether a chunk is due: the first tokens at once, then every stream_interval."""
        num_new = len(self.output_ids) - self.num_sent_tokens
        first = self.num_sent_tokens == 0 and num_new > 0
        return self.finish_reason is not None or first or num_new >= self.stream_interval

    def body(self, with_prompt_ids: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.id,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": "default",
        }
        if self.e2e_latency is not None:
            meta["e2e_latency"] = self.e2e_latency
        if self.logprobs is not None:
            meta.update(self.logprobs.body())
        item = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
        if with_prompt_ids:
            item["prompt_token_ids"] = self.prompt_token_ids
        return item


def _finish_reason(delta: RequestDelta, output_ids: list[int]) -> dict[str, Any] | None:
    """SGLang's: what matched (the stop string, or the stop token or EOS), or the length."""
    if delta.finish_reason == "stop":
        matched = delta.stop_reason
        if matched is None:  # EOS or a finished grammar: the token that ended it
            matched = output_ids[-1] if output_ids else None
        return {"type": "stop", "matched": matched}
    if delta.finish_reason == "length":
        return {"type": "length", "length": delta.num_output_tokens}
    return ABORTED if delta.finish_reason == "abort" else None


def _prompts(body: GenerateRequest, request: Request) -> list[Prompt]:
    body.check_supported()
    engine = request.app.state.engine
    if body.text is not None:
        return completion_prompts(body.text, engine, param="text")
    return completion_prompts(body.input_ids or [], engine, param="input_ids")


def _engine_ids(body: GenerateRequest, count: int, http_request_id: str) -> list[str]:
    """Each prompt's engine request id, SGLang's rid: as given, else the HTTP request's id;
    a batch's prompts get `<rid>_<i>` from one rid."""
    if isinstance(body.rid, list):
        ids = body.per_prompt("rid", count)
        if len(set(ids)) != len(ids) or not all(ids):
            raise invalid_request("rid entries must be distinct, non-empty strings.", "rid")
        return ids
    base = body.rid or http_request_id
    return [f"{base}_{index}" for index in range(count)] if body.is_batch else [base]


def _max_tokens(
    sampling: GenerateSamplingParams, prompt: Prompt, engine: Any, param: str, at: int
) -> int:
    explicit = "max_new_tokens" in sampling.model_fields_set
    return resolve_max_tokens(
        sampling.max_new_tokens if explicit else None,
        None if explicit else engine.sampling_defaults.get("max_tokens", DEFAULT_MAX_NEW_TOKENS),
        len(prompt.token_ids),
        engine.max_model_len,
        param,
        sampling_param(at, "max_new_tokens"),
    )


def _logprobs(
    body: GenerateRequest, prompt: Prompt, index: int, count: int, tokenizer: Any
) -> _Logprobs | None:
    if not body.per_prompt("return_logprob", count)[index]:
        return None
    start = body.per_prompt("logprob_start_len", count)[index]
    num_top = body.per_prompt("top_logprobs_num", count)[index]
    num_prompt_tokens = len(prompt.token_ids)
    if not -1 <= start <= num_prompt_tokens:
        raise invalid_request(
            f"logprob_start_len ({start}) must be -1 (no prompt positions) or at most the "
            f"number of input tokens ({num_prompt_tokens}).",
            "logprob_start_len",
        )
    start = num_prompt_tokens if start == -1 else start
    return _Logprobs(start, num_top, tokenizer if body.return_text_in_logprobs else None)


def _in_sglang_terms(error: SamplingParamsError, at: int) -> APIError:
    """The engine's 400, naming SGLang's field (`max_new_tokens`, not `max_tokens`)."""
    param = error.param
    if param.startswith("sampling_params"):  # a constraint: named already
        return invalid_request(str(error), param)
    top = _TOP_LEVEL.get(param)
    name = top or _SGLANG_NAMES.get(param, param)
    message = str(error).replace(param, name, 1)
    return invalid_request(message, name if top else sampling_param(at, name))


def _plan(
    body: GenerateRequest, request: Request
) -> tuple[list[Prompt], list[EngineInput], list[_Logprobs | None], list[int]]:
    """The prompts, their engine inputs, logprob lists and stream intervals."""
    prompts = _prompts(body, request)
    count = len(prompts)
    samplings = body.sampling(count)
    loras = body.per_prompt("lora_path", count)
    tokenizer = request.app.state.engine.tokenizer
    inputs, logprobs, intervals = [], [], []
    for index, prompt in enumerate(prompts):
        sampling = samplings[index]
        choice_logprobs = _logprobs(body, prompt, index, count, tokenizer)
        if choice_logprobs is not None:
            check_logprobs_cap(request, top_logprobs_num=choice_logprobs.num_top)
        inputs.append(
            _engine_input(body, request, sampling, prompt, index, loras[index], choice_logprobs)
        )
        logprobs.append(choice_logprobs)
        intervals.append(sampling.stream_interval or 1)
    if len({item.params.n for item in inputs}) > 1:
        raise invalid_request("n must be the same for every prompt of a batch.", "sampling_params")
    return prompts, inputs, logprobs, intervals


def _engine_input(
    body: GenerateRequest,
    request: Request,
    sampling: GenerateSamplingParams,
    prompt: Prompt,
    index: int,
    lora: str | None,
    logprobs: _Logprobs | None,
) -> EngineInput:
    engine = request.app.state.engine
    at = index if isinstance(body.sampling_params, list) else -1  # how errors name the field
    sampling.check_supported(at)
    num_top = logprobs.num_top if logprobs is not None else None
    scores_prompt = logprobs is not None and logprobs.start < len(prompt.token_ids)
    prompt_param = "text" if body.text is not None else "input_ids"
    try:
        params = sampling.to_sampling_params(
            max_tokens=_max_tokens(sampling, prompt, engine, prompt_param, at),
            logprobs=num_top,
            prompt_logprobs=num_top if scores_prompt else None,
            logit_bias=parse_logit_bias(sampling.logit_bias, engine.vocab_size),
            structured_outputs=sampling.constraint(at),
            lora=check_model(lora, engine),
            cache_salt=body.cache_salt,
            defaults=engine.sampling_defaults,
        )
    except SamplingParamsError as error:
        raise _in_sglang_terms(error, at) from None
    return EngineInput(prompt.token_ids, params, -(body.priority or 0))


@router.post("/generate")
@router.put("/generate")  # SGLang takes both
async def generate(body: GenerateRequest, request: Request) -> Response:
    prompts, inputs, logprobs, intervals = _plan(body, request)
    n = inputs[0].params.n
    engine_ids = _engine_ids(body, len(prompts), request.state.request_id)
    taken = [rid for rid in engine_ids if rid in request.app.state.engine_requests]
    if taken:  # SGLang's 400 (the engine's own answer, a 429, is for its ids being released)
        raise invalid_request(f"Duplicate request ID detected: {taken[0]!r} is in flight.", "rid")
    outputs = [
        _Output(
            engine_id if n == 1 else f"{engine_id}_{choice}",
            prompt.token_ids,
            _copy(logprobs[index]),
            intervals[index],
        )
        for index, (engine_id, prompt) in enumerate(zip(engine_ids, prompts, strict=True))
        for choice in range(n)
    ]
    recorder = RequestRecorder.of(request, [len(p.token_ids) for p in prompts], n)
    stream = await start_generation(request, inputs, recorder, engine_ids)
    arrival_time = request.state.arrival_time
    if body.stream:
        indexed = len(outputs) > 1  # SGLang's batch chunks say which item they carry
        chunks = _chunks(stream, outputs, n, arrival_time, indexed, body.return_prompt_token_ids)
        return EventStreamResponse(sse_events(chunks))
    async with aclosing(stream):
        async for prompt_idx, delta in stream:
            outputs[prompt_idx * n + delta.index].add(delta, arrival_time)
    items = [output.body(body.return_prompt_token_ids) for output in outputs]
    return JSONResponse(items if body.is_batch or n > 1 else items[0])


def _copy(logprobs: _Logprobs | None) -> _Logprobs | None:
    """Each choice keeps its own lists (a prompt's n choices share the plan)."""
    if logprobs is None:
        return None
    return _Logprobs(logprobs.start, logprobs.num_top, logprobs.tokenizer)


async def _chunks(
    stream: AsyncIterator[Item],
    outputs: list[_Output],
    n: int,
    arrival_time: float,
    indexed: bool,
    with_prompt_ids: bool,
) -> AsyncIterator[str]:
    async with aclosing(stream):
        async for prompt_idx, delta in stream:
            index = prompt_idx * n + delta.index
            output = outputs[index]
            output.add(delta, arrival_time)
            if not output.due():
                continue
            output.num_sent_tokens = len(output.output_ids)
            chunk = output.body(with_prompt_ids)
            if indexed:
                chunk["index"] = index
            yield json.dumps(chunk, ensure_ascii=False)
