"""POST /v1/chat/completions: the model's chat template, OpenAI chat responses and SSE chunks."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.configs import StructuredOutputs
from pagedserve.engine.outputs import TokenLogprob
from pagedserve.server.beam_search import beam_search_params
from pagedserve.server.chat_choice import ChatChoiceText
from pagedserve.server.errors import invalid_request
from pagedserve.server.generation import EngineInput, Item, start_generation
from pagedserve.server.logprobs import (
    check_streamed_prompt_logprobs,
    prompt_logprobs_body,
    resolve_logprobs_counts,
)
from pagedserve.server.prompts import (
    TemplateOptions,
    bad_words_token_ids,
    chat_prompt,
    check_model,
    parse_logit_bias,
    resolve_max_tokens,
    template_kwargs,
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
    UsageInfo,
)
from pagedserve.server.reasoning import (
    ReasoningSplitter,
    leave_thinking_free,
    opens_in_reasoning,
)
from pagedserve.server.recorder import RequestRecorder, usage_so_far
from pagedserve.server.request_fields import check_request_fields
from pagedserve.server.streams import EventStreamResponse, force_usage, sse_events
from pagedserve.server.structured import to_structured_outputs
from pagedserve.server.token_bytes import token_bytes, token_name
from pagedserve.server.tools import ToolPlan, assemble_tool_calls, plan_tools

router = APIRouter()


def _check_logprobs_fields(body: ChatCompletionRequest) -> None:
    """vLLM's checks of the logprobs fields, made before any count is held to --max-logprobs (so
    -1 with stream, say, is refused for streaming). top_logprobs 0 without logprobs asks for
    nothing and is accepted, as vLLM's."""
    if body.top_logprobs and not body.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    check_streamed_prompt_logprobs(body)


def _logprobs_count(body: ChatCompletionRequest) -> int | None:
    """How many alternatives the engine returns per token (None: no logprobs at all)."""
    return (body.top_logprobs or 0) if body.logprobs else None


@dataclass(frozen=True, slots=True)
class _Output:
    """What a request asked to see besides the text: logprobs, and vLLM's token ids."""

    tokenizer: Any
    num_top: int  # alternatives per token, when logprobs are on
    tokens_as_ids: bool  # return_tokens_as_token_ids: logprob tokens named "token_id:<id>"
    prompt_token_ids: list[int] | None  # return_token_ids: the prompt's (else None)
    prompt_text: str | None  # return_prompt_text: the rendered prompt (else None)
    echo: str  # echo: the text every choice's content starts with ("" if none)
    show_reasoning: bool = True  # include_reasoning
    role: str = "assistant"  # the reply's (_reply_role)

    @property
    def token_ids(self) -> bool:
        return self.prompt_token_ids is not None

    def logprobs(self, entries: tuple[TokenLogprob, ...] | None) -> ChatLogprobs | None:
        if entries is None:
            return None
        content = []
        for entry in entries:
            chosen = self._top(entry.token_id, entry.logprob)
            alternatives = [
                self._top(token_id, value) for token_id, value in entry.top_logprobs[: self.num_top]
            ]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        # The token's own bytes, under either name: half an emoji decodes to U+FFFD alone
        # (server/token_bytes.py).
        return TopLogprob(
            token=token_name(self.tokenizer, token_id, self.tokens_as_ids),
            logprob=logprob,
            bytes=list(token_bytes(self.tokenizer, token_id)),
        )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    run = await start_chat(body, request)
    if body.stream:
        return EventStreamResponse(sse_events(_as_json(run.chunks(), body.include_usage)))
    return JSONResponse((await run.response()).model_dump())


async def _as_json(
    chunks: AsyncIterator[ChatCompletionChunk], include_usage: bool
) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}  # "usage": null only when usage is asked for
    async with aclosing(chunks):  # closing this stream closes the engine's at once
        async for chunk in chunks:
            yield chunk.model_dump_json(exclude=exclude)


@dataclass(slots=True)
class ChatRun:
    """A chat request queued in the engine: its reply as OpenAI's chunks (streamed) or as one
    response. The Responses API (server/responses.py) renders its answers from the chunks."""

    stream: AsyncIterator[Item]
    header: dict[str, Any]  # id, created, model
    output: _Output
    choices: list[ChatChoiceText]
    recorder: RequestRecorder
    body: ChatCompletionRequest

    def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        body = self.body
        # continuous_usage_stats: each chunk carries its choice's usage so far (none yet at first)
        num_prompt_tokens = sum(self.recorder.prompt_lengths)
        usage = (
            UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
            if body.continuous_usage
            else None
        )
        return _stream_chunks(
            self.stream, self.header, self.output, self.choices, self.recorder,
            body.include_usage, usage,
        )  # fmt: skip

    async def response(self) -> ChatCompletionResponse:
        return await _collect(
            self.stream,
            self.header,
            self.output,
            self.choices,
            self.recorder,
            self.body.prompt_logprobs,
        )


async def start_chat(body: ChatCompletionRequest, request: Request) -> ChatRun:
    """Check `body`, render its prompt and queue it (an APIError, nothing queued, if invalid)."""
    engine = request.app.state.engine
    lora = check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    force_usage(body, request)
    _check_logprobs_fields(body)
    resolve_logprobs_counts(request, body, "top_logprobs", "prompt_logprobs")
    plan = plan_tools(body, request.app.state.config.server)
    template = TemplateOptions(
        body.add_generation_prompt,
        body.continue_final_message,
        template_kwargs(request, body.chat_template_kwargs),
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
    default = engine.sampling_defaults.get("max_tokens")  # None: the rest of the context
    max_tokens = resolve_max_tokens(
        requested,
        default,
        len(prompt.token_ids),
        engine.max_model_len,
        "messages",
        max_tokens_param,
    )
    if max_tokens == 0 and body.prompt_logprobs is None:
        raise invalid_request(
            f"{max_tokens_param} 0 returns no reply: it needs prompt_logprobs.", max_tokens_param
        )
    num_top = _logprobs_count(body)
    params = body.to_sampling_params(
        max_tokens,
        num_top,
        parse_logit_bias(body.logit_bias, engine.vocab_size),
        _constraint(body, plan),
        prompt_logprobs=body.prompt_logprobs,
        defaults=engine.sampling_defaults,
        bad_words_token_ids=bad_words_token_ids(body.bad_words, engine),
        lora=lora,
    )
    server_parser = request.app.state.config.server.reasoning_parser
    prefill = body.messages[-1].text if body.continue_final_message else ""
    in_reasoning = bool(server_parser) and opens_in_reasoning(server_parser, prompt.text, prefill)
    params = leave_thinking_free(params, server_parser, engine.tokenizer, in_reasoning)
    if plan is not None and plan.shows_special_tokens:  # the parser reads calls after a tag
        params = dataclasses.replace(params, skip_special_tokens=False)
    # A constrained reply is split only where its grammar waits for the end of the think block;
    # otherwise the grammar shapes it whole, from its first token.
    constraint = params.structured_outputs
    reasoning_parser = server_parser if constraint is None or constraint.think else None
    _check_hidden_reasoning(body, server_parser, reasoning_parser)
    max_logprobs = request.app.state.config.model.max_logprobs
    beam = beam_search_params(body, max_tokens, params.structured_outputs, lora, max_logprobs)
    recorder = RequestRecorder.of(request, [len(prompt.token_ids)], params.n)
    stream = await start_generation(
        request, [EngineInput(prompt.token_ids, params, body.priority, beam)], recorder
    )
    header = {
        "id": f"chatcmpl-{recorder.request_id}",
        "created": request.state.created,  # arrival, not the first token
        "model": lora or engine.model_name,
    }
    choices = [
        ChatChoiceText(
            plan.new_parser() if plan else None,
            ReasoningSplitter(in_reasoning) if reasoning_parser else None,
            body.parallel_tool_calls,
            plan.call_id if plan else None,
        )
        for _ in range(params.n)
    ]
    server = request.app.state.config.server
    role = _reply_role(body, server.response_role)
    output = _Output(
        engine.tokenizer,
        num_top or 0,
        body.tokens_as_ids(server.return_tokens_as_token_ids),
        prompt.token_ids if body.return_token_ids else None,
        prompt.text if body.return_prompt_text else None,
        _echo(body, role),
        body.include_reasoning,
        role,
    )
    return ChatRun(stream, header, output, choices, recorder, body)


def _check_hidden_reasoning(
    body: ChatCompletionRequest, server_parser: str | None, reasoning_parser: str | None
) -> None:
    """include_reasoning false needs a server that can tell the reasoning apart; and with the
    reasoning left out, the per-token fields would still spell it: both refused rather than
    answered as if honoured. (A constrained reply that the grammar shapes whole is not split:
    there is none to leave out.)"""
    if body.include_reasoning:
        return
    if server_parser is None:
        raise invalid_request(
            "include_reasoning false needs the server's --reasoning-parser.", "include_reasoning"
        )
    if reasoning_parser is None:
        return
    for name in ("logprobs", "return_token_ids"):
        if getattr(body, name):
            raise invalid_request(
                f"{name} would reveal the reasoning that include_reasoning false leaves out.", name
            )


def _reply_role(body: ChatCompletionRequest, response_role: str) -> str:
    """The role the reply names, as vLLM's: --response-role after a generation prompt, else the
    last message's (the model continues that message)."""
    return response_role if body.add_generation_prompt else body.messages[-1].role


def _echo(body: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's text when it has the reply's role (a prefill the
    model continues), else nothing."""
    last = body.messages[-1]
    return last.text if body.echo and last.role == role else ""


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


async def _stream_chunks(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    output: _Output,
    choices: list[ChatChoiceText],
    recorder: RequestRecorder,
    include_usage: bool,
    usage: UsageInfo | None = None,
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(
        index: int, delta: ChatDelta, first: bool = False, **fields: Any
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, **fields)
        prompt = {"prompt_token_ids": output.prompt_token_ids, "prompt_text": output.prompt_text}
        return ChatCompletionChunk(
            **header, choices=[choice], usage=usage, **(prompt if first else {})
        )

    async with aclosing(stream):
        for index in range(len(choices)):  # OpenAI's first chunk of every choice: the role
            yield chunk(index, ChatDelta(role=output.role, content=""), first=True)
            if output.echo:
                yield chunk(index, ChatDelta(content=output.echo))
        async for _, delta in stream:
            if usage is not None:
                usage = usage_so_far(delta)
            choice = choices[delta.index]
            logprobs = output.logprobs(delta.new_logprobs)
            # Every token's id is sent (return_token_ids), held-back text or not.
            token_ids = list(delta.new_token_ids) if output.token_ids else None
            piece = choice.take(delta.new_text)
            if delta.finished:
                piece += choice.finish(delta.finish_reason)
            reasoning = piece.reasoning if output.show_reasoning else ""
            text, calls = piece.content, piece.calls
            if not (reasoning or text or logprobs or token_ids or calls or delta.finished):
                continue  # held back (a partial character, stop string, tag or hidden reasoning)
            content = ChatDelta(content=text or None, reasoning=reasoning or None)
            fields = {"logprobs": logprobs, "token_ids": token_ids}
            finish_reason = choice.finish_reason if delta.finished else None
            finish = {"finish_reason": finish_reason, "stop_reason": delta.stop_reason}
            if not calls:
                yield chunk(delta.index, content, **finish, **fields)
                continue
            if reasoning or text or logprobs or token_ids:
                yield chunk(delta.index, content, **fields)
            for call in calls:  # a call's id and name first, then its arguments as they come
                yield chunk(delta.index, ChatDelta(tool_calls=[call]))
            if finish_reason is not None:
                yield chunk(delta.index, ChatDelta(), **finish)
    if include_usage:
        yield ChatCompletionChunk(**header, choices=[], usage=recorder.usage())


async def _collect(
    stream: AsyncIterator[Item],
    header: dict[str, Any],
    output: _Output,
    choices: list[ChatChoiceText],
    recorder: RequestRecorder,
    num_prompt_top: int | None,
) -> ChatCompletionResponse:
    prompt_logprobs = None
    async with aclosing(stream):
        async for _, delta in stream:
            if num_prompt_top is not None and delta.prompt_logprobs and prompt_logprobs is None:
                prompt_logprobs = prompt_logprobs_body(
                    output.tokenizer, delta.prompt_logprobs, num_prompt_top
                )
            choice = choices[delta.index]
            choice.text += delta.new_text
            choice.token_ids += delta.new_token_ids
            new_logprobs = output.logprobs(delta.new_logprobs)
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
            choice.stop_reason = delta.stop_reason if delta.finished else choice.stop_reason
    results = []
    for index, choice in enumerate(choices):
        piece = choice.take(choice.text) + choice.finish(choice.finish_reason)
        content = output.echo + piece.content
        calls = assemble_tool_calls(piece.calls)
        reasoning = piece.reasoning if output.show_reasoning else ""
        message = ChatResponseMessage(
            role=output.role,
            content=None if (calls or piece.reasoning) and not content.strip() else content,
            tool_calls=calls or None,
            reasoning=reasoning or None,
        )
        results.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=choice.logprobs,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                token_ids=choice.token_ids if output.token_ids else None,
            )
        )
    return ChatCompletionResponse(
        **header,
        choices=results,
        usage=recorder.usage(),
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=output.prompt_token_ids,
        prompt_text=output.prompt_text,
    )
