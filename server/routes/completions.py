"""POST /v1/completions: OpenAI's (legacy) text completions, batched prompts, SSE streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.server.beam_search import beam_search_params
from pagedserve.server.errors import invalid_request
from pagedserve.server.generation import EngineInput, Item, start_generation
from pagedserve.server.logprobs import (
    ChoiceText,
    check_streamed_prompt_logprobs,
    prompt_logprobs_body,
    resolve_logprobs_counts,
)
from pagedserve.server.prompts import (
    bad_words_token_ids,
    check_model,
    completion_prompts,
    parse_logit_bias,
    resolve_max_tokens,
    truncated,
)
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedserve.server.recorder import RequestRecorder, usage_so_far
from pagedserve.server.request_fields import check_request_fields
from pagedserve.server.streams import EventStreamResponse, force_usage, sse_events
from pagedserve.server.structured import to_structured_outputs

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _check_supported(body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise invalid_request("suffix is not supported.", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise invalid_request("best_of must equal n (or be omitted).", "best_of")
    check_streamed_prompt_logprobs(body, "; use echo with logprobs")  # the legacy lists stream
    if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise invalid_request(
            "max_tokens 0 returns only the prompt: it needs echo or prompt_logprobs.", "max_tokens"
        )


def _engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many alternatives the engine scores per prompt token (None: no prompt logprobs): for
    the echoed legacy lists, for vLLM's `prompt_logprobs`, or (max_tokens 0 with a bare echo)
    none, since the prompt is then all the request returns."""
    wanted = [body.prompt_logprobs] if body.prompt_logprobs is not None else []
    if body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    if body.max_tokens == 0 and not wanted:
        wanted.append(0)
    return max(wanted) if wanted else None


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    engine = request.app.state.engine
    lora = check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    _check_supported(body)
    force_usage(body, request)
    resolve_logprobs_counts(request, body, "logprobs", "prompt_logprobs")
    prompts = [
        truncated(prompt, body.truncate_prompt_tokens, engine)
        for prompt in completion_prompts(body.prompt, engine, body.add_special_tokens)
    ]
    logit_bias = parse_logit_bias(body.logit_bias, engine.vocab_size)
    bad_words = bad_words_token_ids(body.bad_words, engine)
    structured_outputs = to_structured_outputs(body)
    max_logprobs = request.app.state.config.model.max_logprobs
    inputs = []
    for prompt in prompts:
        max_tokens = resolve_max_tokens(
            body.max_tokens,
            engine.sampling_defaults.get("max_tokens", DEFAULT_MAX_TOKENS),
            len(prompt.token_ids),
            engine.max_model_len,
            "prompt",
        )
        params = body.to_sampling_params(
            max_tokens,
            body.logprobs,
            logit_bias,
            structured_outputs,
            prompt_logprobs=_engine_prompt_logprobs(body),
            defaults=engine.sampling_defaults,
            bad_words_token_ids=bad_words,
            lora=lora,
        )
        beam = beam_search_params(body, max_tokens, structured_outputs, lora, max_logprobs)
        inputs.append(EngineInput(prompt.token_ids, params, body.priority, beam))
    n = inputs[0].params.n
    recorder = RequestRecorder.of(request, [len(p.token_ids) for p in prompts], n)
    stream = await start_generation(request, inputs, recorder)
    header = {
        "id": f"cmpl-{recorder.request_id}",
        "created": request.state.created,  # arrival, not the first token
        "model": lora or engine.model_name,
    }
    num_echo_top = body.logprobs if body.echo else None
    tokens_as_ids = body.tokens_as_ids(request.app.state.config.server.return_tokens_as_token_ids)
    choices = {
        (prompt_idx, index): ChoiceText(
            engine.tokenizer,
            prompt.text if body.echo else "",
            prompt.token_ids,
            num_echo_top,
            tokens_as_ids,
        )
        for prompt_idx, prompt in enumerate(prompts)
        for index in range(n)
    }
    if body.stream:
        chunks = _stream_chunks(
            stream,
            header,
            choices,
            n,
            recorder,
            body.include_usage,
            body.continuous_usage,
            body.return_token_ids,
        )
        return EventStreamResponse(sse_events(chunks))
    response = await _collect(
        stream, header, choices, n, recorder, body.prompt_logprobs, body.return_token_ids
    )
    return JSONResponse(response.model_dump())


async def _stream_chunks(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    choices: dict[tuple[int, int], ChoiceText],
    n: int,
    recorder: RequestRecorder,
    include_usage: bool,
    continuous_usage: bool,
    return_token_ids: bool,
) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}  # "usage": null only when usage is asked for
    started: set[tuple[int, int]] = set()  # choices whose first chunk (with the prompt's ids) went
    async with aclosing(stream):
        async for prompt_idx, delta in stream:
            key = (prompt_idx, delta.index)
            text, logprobs = choices[key].take(delta)
            token_ids = list(delta.new_token_ids) if return_token_ids else None
            if not (text or logprobs or token_ids or delta.finished):
                continue  # text held back by the detokenizer (partial character or stop string)
            choice = CompletionChoice(
                index=prompt_idx * n + delta.index,
                text=text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
                token_ids=token_ids,
            )
            if return_token_ids and key not in started:
                started.add(key)
                choice.prompt_token_ids = choices[key].prompt_token_ids
            usage = usage_so_far(delta) if continuous_usage else None
            yield CompletionResponse(**header, choices=[choice], usage=usage).model_dump_json(
                exclude=exclude
            )
    if include_usage:
        yield CompletionResponse(**header, choices=[], usage=recorder.usage()).model_dump_json()


async def _collect(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    choices: dict[tuple[int, int], ChoiceText],
    n: int,
    recorder: RequestRecorder,
    num_prompt_top: int | None,
    return_token_ids: bool,
) -> CompletionResponse:
    results = {
        key: CompletionChoice(
            index=key[0] * n + key[1],
            text="",
            prompt_token_ids=choice.prompt_token_ids if return_token_ids else None,
            token_ids=[] if return_token_ids else None,
        )
        for key, choice in choices.items()
    }
    async with aclosing(stream):
        async for prompt_idx, delta in stream:
            result = results[(prompt_idx, delta.index)]
            choice_text = choices[(prompt_idx, delta.index)]
            text, logprobs = choice_text.take(delta)
            result.text += text
            if result.token_ids is not None:
                result.token_ids += delta.new_token_ids
            if logprobs is not None:
                result.logprobs = _concat(result.logprobs, logprobs)
            if num_prompt_top is not None and delta.prompt_logprobs is not None:
                result.prompt_logprobs = prompt_logprobs_body(
                    choice_text.tokenizer, delta.prompt_logprobs, num_prompt_top
                )
            result.finish_reason = delta.finish_reason or result.finish_reason
            result.stop_reason = delta.stop_reason if delta.finished else result.stop_reason
    ordered = sorted(results.values(), key=lambda choice: choice.index)
    return CompletionResponse(**header, choices=ordered, usage=recorder.usage())


def _concat(head: CompletionLogprobs | None, tail: CompletionLogprobs) -> CompletionLogprobs:
    if head is None:
        return tail
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )
