"""POST /v1/chat/completions: the model's chat template, OpenAI chat responses and SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.configs import StructuredOutputs
from pagedserve.engine.outputs import TokenLogprob
from pagedserve.server.errors import invalid_request
from pagedserve.server.generation import EngineInput, Item, start_generation
from pagedserve.server.logprobs import prompt_logprobs_body
from pagedserve.server.prompts import (
    TemplateOptions,
    bad_words_token_ids,
    chat_prompt,
    check_model,
    parse_logit_bias,
    resolve_max_tokens,
    truncated,
)
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
from pagedserve.server.request_fields import check_request_fields
from pagedserve.server.streams import EventStreamResponse, sse_events
from pagedserve.server.structured import to_structured_outputs
from pagedserve.server.token_bytes import token_bytes
from pagedserve.server.tool_parsers import ToolCallParser
from pagedserve.server.tool_protocol import ToolCall
from pagedserve.server.tools import ToolPlan, plan_tools, to_tool_calls, tool_call_deltas

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
        # The token's own bytes: half an emoji decodes to U+FFFD alone (server/token_bytes.py).
        return TopLogprob(
            token=token, logprob=logprob, bytes=list(token_bytes(tokenizer, token_id))
        )

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
    check_request_fields(body, request.state.request_id)
    plan = plan_tools(body, request.app.state.config.server)
    template = TemplateOptions(
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs or {},
        body.add_special_tokens,
    )
    prompt = truncated(
        chat_prompt(body.messages, engine, plan.tools if plan else None, template),
        body.truncate_prompt_tokens,
        engine,
    )
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
    if body.stream and body.prompt_logprobs is not None:  # as vLLM
        raise invalid_request("prompt_logprobs is not available when streaming.", "prompt_logprobs")
    params = body.to_sampling_params(
        max_tokens,
        num_top,
        parse_logit_bias(body.logit_bias, engine.vocab_size),
        _constraint(body, plan),
        prompt_logprobs=body.prompt_logprobs,
        defaults=engine.sampling_defaults,
        bad_words_token_ids=bad_words_token_ids(body.bad_words, engine),
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
        "created": request.state.created,  # arrival, not the first token
        "model": engine.model_name,
    }
    choices = [
        _Choice(plan.new_parser() if plan else None, body.parallel_tool_calls)
        for _ in range(params.n)
    ]
    if body.stream:
        chunks = _stream_chunks(
            stream, header, engine.tokenizer, choices, num_top or 0, recorder, body.include_usage
        )
        return EventStreamResponse(sse_events(chunks))
    response = await _collect(
        stream, header, engine.tokenizer, choices, num_top or 0, recorder, body.prompt_logprobs
    )
    return JSONResponse(response.model_dump())


def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None) -> StructuredOutputs | None:
    requested = to_structured_outputs(body)
    if plan is None or plan.constraint is None:
        return requested
    if requested is not None:
        raise invalid_request(
            f"tool_choice {plan.mode} constrains the output; it cannot be combined with "
            f"{requested.param}",
            "tool_choice",
        )
    return plan.constraint


class _Choice:
    """One choice's text as it streams; with tools, what its parser lets through."""

    def __init__(self, parser: ToolCallParser | None, parallel_calls: bool = True) -> None:
        self.parser = parser
        self.parallel_calls = parallel_calls  # False: at most one call (OpenAI's field)
        self.text = ""
        self.logprobs: ChatLogprobs | None = None
        self.finish_reason: str | None = None

    def take(self, text: str) -> str:
        return self.parser.feed(text) if self.parser is not None else text

    def finish(self, finish_reason: str | None) -> tuple[str, list[ToolCall]]:
        """The held-back text and the calls; "stop" becomes "tool_calls" when there are calls."""
        tail, calls = self.parser.finish() if self.parser is not None else ("", [])
        if not self.parallel_calls:  # "required" enforces it in its grammar; auto's parser here
            calls = calls[:1]
        self.finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        return tail, to_tool_calls(calls)


async def _stream_chunks(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    tokenizer: Any,
    choices: list[_Choice],
    num_top: int,
    recorder: RequestRecorder,
    include_usage: bool,
) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}  # "usage": null only when usage is asked for

    def chunk(index: int, delta: ChatDelta, **fields: Any) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, **fields)
        return ChatCompletionChunk(**header, choices=[choice]).model_dump_json(exclude=exclude)

    async with aclosing(stream):
        for index in range(len(choices)):  # OpenAI's first chunk of every choice: the role
            yield chunk(index, ChatDelta(role="assistant", content=""))
        async for _, delta in stream:
            choice = choices[delta.index]
            logprobs = _chat_logprobs(tokenizer, delta.new_logprobs, num_top)
            text, calls = choice.take(delta.new_text), []
            if delta.finished:
                tail, calls = choice.finish(delta.finish_reason)
                text += tail
            if not (text or logprobs or delta.finished):
                continue  # held back (a partial character, stop string or tool-call tag)
            content = ChatDelta(content=text or None)
            if not calls:
                finish_reason = choice.finish_reason if delta.finished else None
                yield chunk(delta.index, content, logprobs=logprobs, finish_reason=finish_reason)
                continue
            if text or logprobs:
                yield chunk(delta.index, content, logprobs=logprobs)
            for call_index, call in enumerate(calls):  # name first, then the arguments
                for piece in tool_call_deltas(call_index, call):
                    yield chunk(delta.index, ChatDelta(tool_calls=[piece]))
            yield chunk(delta.index, ChatDelta(), finish_reason=choice.finish_reason)
    if include_usage:
        yield ChatCompletionChunk(**header, choices=[], usage=recorder.usage()).model_dump_json()


async def _collect(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    tokenizer: Any,
    choices: list[_Choice],
    num_top: int,
    recorder: RequestRecorder,
    num_prompt_top: int | None,
) -> ChatCompletionResponse:
    prompt_logprobs = None
    async with aclosing(stream):
        async for _, delta in stream:
            if num_prompt_top is not None and delta.prompt_logprobs and prompt_logprobs is None:
                prompt_logprobs = prompt_logprobs_body(
                    tokenizer, delta.prompt_logprobs, num_prompt_top
                )
            choice = choices[delta.index]
            choice.text += delta.new_text
            new_logprobs = _chat_logprobs(tokenizer, delta.new_logprobs, num_top)
            if new_logprobs is not None:
                previous = choice.logprobs
                choice.logprobs = (
                    new_logprobs
                    if previous is None
                    else ChatLogprobs(
                        content=(previous.content or []) + (new_logprobs.content or [])
                    )
                )
            choice.finish_reason = delta.finish_reason or choice.finish_reason
    results = []
    for index, choice in enumerate(choices):
        content = choice.take(choice.text)
        tail, calls = choice.finish(choice.finish_reason)
        content += tail
        message = ChatResponseMessage(
            content=None if calls and not content.strip() else content,
            tool_calls=calls or None,
        )
        results.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=choice.logprobs,
                finish_reason=choice.finish_reason,
            )
        )
    return ChatCompletionResponse(
        **header, choices=results, usage=recorder.usage(), prompt_logprobs=prompt_logprobs
    )
