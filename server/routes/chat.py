"""POST /v1/chat/completions: the model's chat template, OpenAI chat responses and SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.server.errors import invalid_request
from pagedserve.server.generation import EngineInput, Item, start_generation
from pagedserve.server.prompts import chat_prompt, check_model, parse_logit_bias, resolve_max_tokens
from pagedserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from pagedserve.server.recorder import RequestRecorder
from pagedserve.server.streams import EventStreamResponse, sse_events
from pagedserve.server.structured import to_structured_outputs

router = APIRouter()


def _logprobs_count(body: ChatCompletionRequest) -> int | None:
    """How many alternatives the engine returns per token (None: no logprobs at all)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _chat_logprobs(
    tokenizer: Any, entries: tuple[TokenLogprob, ...] | None, num_top: int
) -> ChatLogprobs | None:
    if entries is None:
        return None

    def top(token_id: int, logprob: float) -> TopLogprob:
        token = tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    content = []
    for entry in entries:
        chosen = top(entry.token_id, entry.logprob)
        alternatives = [top(token_id, value) for token_id, value in entry.top_logprobs[:num_top]]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    engine = request.app.state.engine
    check_model(body.model, engine)
    prompt = chat_prompt(body.messages, engine)
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens_param = (
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    max_tokens = resolve_max_tokens(
        requested, None, len(prompt.token_ids), engine.max_model_len, "messages", max_tokens_param
    )
    num_top = _logprobs_count(body)
    params = body.to_sampling_params(
        max_tokens,
        num_top,
        parse_logit_bias(body.logit_bias, engine.vocab_size),
        to_structured_outputs(body),
    )
    recorder = RequestRecorder(
        request.app.state.metrics,
        request.state.request_id,
        request.state.arrival_time,
        [len(prompt.token_ids)],
        params.n,
    )
    stream = await start_generation(
        request, [EngineInput(prompt.token_ids, params, body.priority)], recorder
    )
    header = {
        "id": f"chatcmpl-{recorder.request_id}",
        "created": int(time.time()),
        "model": engine.model_name,
    }
    if body.stream:
        chunks = _stream_chunks(
            stream, header, engine.tokenizer, params.n, num_top or 0, recorder, body.include_usage
        )
        return EventStreamResponse(sse_events(chunks))
    response = await _collect(stream, header, engine.tokenizer, params.n, num_top or 0, recorder)
    return JSONResponse(response.model_dump())


async def _stream_chunks(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    tokenizer: Any,
    n: int,
    num_top: int,
    recorder: RequestRecorder,
    include_usage: bool,
) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}  # "usage": null only when usage is asked for

    def chunk(choice: ChatChunkChoice) -> str:
        return ChatCompletionChunk(**header, choices=[choice]).model_dump_json(exclude=exclude)

    async with aclosing(stream):
        for index in range(n):  # OpenAI's first chunk of every choice carries only the role
            yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))
        async for _, delta in stream:
            logprobs = _chat_logprobs(tokenizer, delta.new_logprobs, num_top)
            if not (delta.new_text or logprobs or delta.finished):
                continue  # text held back by the detokenizer (partial character or stop string)
            content = ChatDelta(content=delta.new_text) if delta.new_text else ChatDelta()
            yield chunk(
                ChatChunkChoice(
                    index=delta.index,
                    delta=content,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                )
            )
    if include_usage:
        yield ChatCompletionChunk(**header, choices=[], usage=recorder.usage()).model_dump_json()


async def _collect(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    tokenizer: Any,
    n: int,
    num_top: int,
    recorder: RequestRecorder,
) -> ChatCompletionResponse:
    texts = [""] * n
    logprobs: list[ChatLogprobs | None] = [None] * n
    finish_reasons: list[str | None] = [None] * n
    async with aclosing(stream):
        async for _, delta in stream:
            texts[delta.index] += delta.new_text
            new_logprobs = _chat_logprobs(tokenizer, delta.new_logprobs, num_top)
            if new_logprobs is not None:
                previous = logprobs[delta.index]
                logprobs[delta.index] = (
                    new_logprobs
                    if previous is None
                    else ChatLogprobs(
                        content=(previous.content or []) + (new_logprobs.content or [])
                    )
                )
            finish_reasons[delta.index] = delta.finish_reason or finish_reasons[delta.index]
    choices = [
        ChatChoice(
            index=index,
            message=ChatResponseMessage(content=texts[index]),
            logprobs=logprobs[index],
            finish_reason=finish_reasons[index],
        )
        for index in range(n)
    ]
    return ChatCompletionResponse(**header, choices=choices, usage=recorder.usage())
