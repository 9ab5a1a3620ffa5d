"""The Responses API over the chat route: a /v1/responses request becomes a chat request
(`to_chat_request`), and the chat route's streamed chunks become the Responses API's output
items and events (`ResponseBuilder`), streamed or collected into one response object.

What a chat request can express is served; the rest is a 400 naming the field rather than an
answer that ignores it: hosted tools (web search, file search...), images and files in the input,
and background runs. Earlier reasoning items in `input` are dropped, as chat templates drop
earlier turns' reasoning. Stored responses (`previous_response_id`): server/response_store.py.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError

from pagedserve.server.errors import invalid_request
from pagedserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatTokenLogprob,
    UsageInfo,
)
from pagedserve.server.responses_protocol import (
    INCLUDABLE,
    ContentPart,
    FunctionCallItem,
    InputItem,
    InputTokensDetails,
    MessageItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)

# The chat request's parameter names, as the Responses API calls them (in error messages).
RESPONSES_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
    "truncate_prompt_tokens": "truncation",
}
# The same in a location or a message: whole names only ("set_response_format" stays).
_CHAT_NAMES = re.compile(
    r"(?<![\w.])(max_completion_tokens|max_tokens|response_format\.json_schema|response_format)"
    r"(?!\w)|(?<=tools\.)(\d+)\.function(?=\.)"
)
_RENAMED = {"response_format.json_schema": "text.format"} | RESPONSES_PARAM


def in_responses_terms(text: str) -> str:
    """`text` with chat's names of the Responses API's parameters replaced by their names here
    (a tool's `function` level too: this API's tools are flat)."""
    return _CHAT_NAMES.sub(lambda m: m.group(2) or _RENAMED[m.group(1)], text)


# vLLM's sampling extensions: the same name and meaning in both APIs.
PASSED_ON = (
    *("model", "temperature", "top_p", "parallel_tool_calls", "user", "top_k", "include_reasoning"),
    *("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop"),
    *("stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids"),
    *("bad_words", "cache_salt", "include_stop_str_in_output", "skip_special_tokens", "priority"),
    "structured_outputs",
)
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def to_chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]], turn: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that computes `body`'s answer, given the earlier turns' messages
    (`previous_response_id`) and this turn's (`input_messages`): streamed with usage after every
    chunk (the builder counts reasoning tokens from it). Raises a 400 APIError for what chat
    cannot do."""
    _refuse_unservable(body)
    fields: dict[str, Any] = {
        name: getattr(body, name) for name in PASSED_ON if getattr(body, name) is not None
    }
    instructions = [] if body.instructions is None else [_system(body.instructions)]
    fields |= {
        "messages": [*instructions, *history, *turn],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": body.max_output_tokens,
        "chat_template_kwargs": _template_kwargs(body),
    }
    if "message.output_text.logprobs" in (body.include or []):
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    if body.truncation == "auto":
        fields["truncate_prompt_tokens"] = -1
    if body.tools:
        fields["tools"] = [_chat_tool(index, tool) for index, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(body.tool_choice)
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = _response_format(text_format)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        problem = error.errors()[0]
        where = in_responses_terms(".".join(str(part) for part in problem["loc"]))
        first = str(problem["loc"][0]) if problem["loc"] else "input"
        param = RESPONSES_PARAM.get(first, first)
        raise invalid_request(f"{where}: {in_responses_terms(problem['msg'])}", param) from None


def _refuse_unservable(body: ResponsesRequest) -> None:
    if body.background and body.stream:
        raise invalid_request(
            "background with stream is not supported: poll GET /v1/responses/{id}.", "stream"
        )
    for entry in body.include or []:
        if entry not in INCLUDABLE:
            raise invalid_request(f"include: unknown value {entry!r}.", "include")
    if body.top_logprobs and "message.output_text.logprobs" not in (body.include or []):
        raise invalid_request(
            "top_logprobs needs include: ['message.output_text.logprobs'].", "top_logprobs"
        )
    for name in ("prompt", "conversation"):
        if (body.model_extra or {}).get(name) is not None:
            raise invalid_request(f"{name} is not supported by this server.", name)


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """`reasoning.effort` reaches the chat template as vLLM passes it: `reasoning_effort`, and
    `enable_thinking` (false for "none") unless the request set it."""
    kwargs = dict(body.chat_template_kwargs or {})
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs or None


def _system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat messages (400 for an item that cannot be one)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(body.input):
        _add_item(messages, item, f"input[{index}]")
    if not messages:
        raise invalid_request("input holds no message.", "input")
    return messages


def output_messages(response: ResponseObject) -> list[dict[str, Any]]:
    """A response's output as the assistant turn a chat template reads back: its text and its
    calls (reasoning left out, as templates leave earlier reasoning out)."""
    text = "".join(
        part.text
        for item in response.output
        if isinstance(item, MessageItem)
        for part in item.content
    )
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    return [message | ({"tool_calls": calls} if calls else {})]


def _add_item(messages: list[dict[str, Any]], item: InputItem, where: str) -> None:
    """Append `item` to the chat messages: a function call joins the assistant turn before it."""
    if item.type == "message":
        if item.role is None or item.content is None:
            raise invalid_request(f"{where}: a message needs role and content.", "input")
        messages.append({"role": item.role, "content": _text(item.content, f"{where}.content")})
    elif item.type == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            raise invalid_request(
                f"{where}: a function_call needs call_id, name and arguments.", "input"
            )
        call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            raise invalid_request(
                f"{where}: a function_call_output needs call_id and output.", "input"
            )
        output = _text(item.output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    elif item.type != "reasoning":  # earlier reasoning: dropped, as chat templates drop it
        raise invalid_request(
            f"{where}: items of type {item.type!r} are not supported (message, function_call, "
            "function_call_output and reasoning are).",
            "input",
        )


def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        text = part.text if part.type != "refusal" else part.refusal
        if part.type not in TEXT_PARTS or text is None:
            raise invalid_request(
                f"{where}[{index}]: only text parts are read ({', '.join(TEXT_PARTS)}); "
                f"this server reads no {part.type!r}.",
                "input",
            )
        texts.append(text)
    return "\n".join(texts)


def _chat_tool(index: int, tool: Any) -> dict[str, Any]:
    if tool.type != "function" or tool.name is None:
        raise invalid_request(
            f"tools[{index}]: only function tools (with a name) are supported; "
            f"this server runs no {tool.type!r} tool.",
            "tools",
        )
    function = {"name": tool.name, "description": tool.description}
    function |= {"parameters": tool.parameters, "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: chat's check names anything else
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid_request(
        "tool_choice: auto, none, required or {'type': 'function', 'name': ...}.", "tool_choice"
    )


def _response_format(text_format: Any) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.name is None or text_format.schema_ is None:
        raise invalid_request("text.format: json_schema needs name and schema.", "text.format")
    schema = {"name": text_format.name, "schema": text_format.schema_}
    schema |= {"strict": text_format.strict, "description": text_format.description}
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Turns the chat route's chunks (one choice) into output items, with the events that stream
    them: items open in the order their text starts (reasoning, the message, each call) and the
    one open before is finished first, as OpenAI's streams do."""

    def __init__(
        self, response: ResponseObject, keep: Callable[[ResponseObject], bool] | None = None
    ) -> None:
        """`keep`: stores the finished response (store: true), False if it could not."""
        self.response = response
        self.keep = keep
        self.sequence_number = 0
        self._open: ReasoningItem | MessageItem | FunctionCallItem | None = None
        self._calls: dict[int, FunctionCallItem] = {}  # chat's call index -> its item
        self._usage: UsageInfo | None = None
        self._reasoning_tokens = 0
        self._finish_reason: str | None = None
        # Logprobs of tokens whose text is held back (part of a character, a tag): they go with
        # the text that follows, so the message's logprobs cover its text's tokens.
        self._pending_logprobs: list[ChatTokenLogprob] = []

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response.model_dump()
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def add(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        """The events of one chat chunk (none for the role chunk)."""
        self._usage = chunk.usage or self._usage
        events: list[dict[str, Any]] = []
        for choice in chunk.choices:
            delta = choice.delta
            logprobs = (choice.logprobs.content if choice.logprobs else None) or []
            if delta.reasoning:
                events += self._reasoning(delta.reasoning)
                self._pending_logprobs = []  # reasoning's tokens: not the message's
                if self._usage is not None:  # tokens up to the last one that was reasoning
                    self._reasoning_tokens = self._usage.completion_tokens
            if delta.content:
                events += self._text(delta.content, [*self._pending_logprobs, *logprobs])
                self._pending_logprobs = []
            elif not delta.reasoning:
                self._pending_logprobs += logprobs
            for call in delta.tool_calls or []:
                events += self._call(
                    call.index, call.id, call.function.name, call.function.arguments
                )
            self._finish_reason = choice.finish_reason or self._finish_reason
        return events

    @property
    def aborted(self) -> bool:
        """Whether the engine ended the reply with an abort (/abort_request, shutdown)."""
        return self._finish_reason == "abort"

    def finish(self) -> list[dict[str, Any]]:
        """Close the open item and the response: `completed`, or `incomplete` when the output
        reached max_output_tokens (and so does the item it cut short)."""
        if isinstance(self._open, MessageItem):  # the last tokens' (the stop token's)
            self._open.content[0].logprobs += self._pending_logprobs
        events = self._close(cut=self._finish_reason == "length")
        response = self.response
        if self._finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = {"reason": "max_output_tokens"}
        else:
            response.status = "completed"
        usage = self._usage or UsageInfo(prompt_tokens=0, total_tokens=0)
        response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=_input_details(usage),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens),
            total_tokens=usage.total_tokens,
        )
        if self.keep is not None:  # stored as its final event shows it
            response.store = self.keep(response)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response.model_dump())]

    def fail(self, code: str, message: str) -> dict[str, Any]:
        self.response.status = "failed"
        self.response.error = {"code": code, "message": message}
        return self.event("response.failed", response=self.response.model_dump())

    # ---- items -----------------------------------------------------------------------------

    def _begin(self, item: ReasoningItem | MessageItem | FunctionCallItem) -> list[dict[str, Any]]:
        events = self._close()
        self.response.output.append(item)
        self._open = item
        added = self.event(
            "response.output_item.added", output_index=self._index(item), item=item.model_dump()
        )
        events.append(added)
        if isinstance(item, ReasoningItem):
            item.content.append(ReasoningText())
        elif isinstance(item, MessageItem):
            item.content.append(OutputText())
        if not isinstance(item, FunctionCallItem):
            events.append(self._part_event("response.content_part.added", item))
        return events

    def _index(self, item: ReasoningItem | MessageItem | FunctionCallItem) -> int:
        return next(i for i, output in enumerate(self.response.output) if output is item)

    def _part_event(self, kind: str, item: ReasoningItem | MessageItem) -> dict[str, Any]:
        part = item.content[0].model_dump()
        return self.event(
            kind, item_id=item.id, output_index=self._index(item), content_index=0, part=part
        )

    def _item_event(
        self, kind: str, item: ReasoningItem | MessageItem | FunctionCallItem, **fields: Any
    ) -> dict[str, Any]:
        """An event about `item`'s text (a call's arguments have no content index)."""
        content = {} if isinstance(item, FunctionCallItem) else {"content_index": 0}
        return self.event(
            kind, item_id=item.id, output_index=self._index(item), **content, **fields
        )

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        item = self._open
        events = []
        if not isinstance(item, ReasoningItem):
            item = ReasoningItem(id=new_id("rs"))
            events = self._begin(item)
        item.content[0].text += text
        return [*events, self._item_event("response.reasoning_text.delta", item, delta=text)]

    def _text(self, text: str, logprobs: list[ChatTokenLogprob]) -> list[dict[str, Any]]:
        item = self._open
        events = []
        if not isinstance(item, MessageItem):
            item = MessageItem(id=new_id("msg"))
            events = self._begin(item)
        part = item.content[0]
        part.text += text
        part.logprobs += logprobs
        entries = [entry.model_dump() for entry in logprobs]
        delta = self._item_event("response.output_text.delta", item, delta=text, logprobs=entries)
        return [*events, delta]

    def _call(
        self, index: int, call_id: str | None, name: str | None, arguments: str | None
    ) -> list[dict[str, Any]]:
        """Chat streams a call's id and name first, then its arguments."""
        events = []
        if index not in self._calls:
            item = FunctionCallItem(
                id=new_id("fc"), call_id=call_id or new_id("call"), name=name or ""
            )
            self._calls[index] = item
            events = self._begin(item)
        item = self._calls[index]
        if arguments:
            item.arguments += arguments
            events.append(
                self._item_event("response.function_call_arguments.delta", item, delta=arguments)
            )
        return events

    def _close(self, cut: bool = False) -> list[dict[str, Any]]:
        """The events that finish the open item (none if there is none); `cut`: the output ended
        inside it (max_output_tokens)."""
        item, self._open = self._open, None
        if item is None:
            return []
        if isinstance(item, FunctionCallItem):
            done = {"name": item.name, "arguments": item.arguments}
            events = [self._item_event("response.function_call_arguments.done", item, **done)]
        elif isinstance(item, ReasoningItem):
            text = item.content[0].text
            events = [self._item_event("response.reasoning_text.done", item, text=text)]
        else:
            part = item.content[0]
            logprobs = [entry.model_dump() for entry in part.logprobs]
            events = [
                self._item_event(
                    "response.output_text.done", item, text=part.text, logprobs=logprobs
                )
            ]
        if not isinstance(item, FunctionCallItem):
            events.append(self._part_event("response.content_part.done", item))
        item.status = "incomplete" if cut else "completed"
        events.append(
            self.event(
                "response.output_item.done", output_index=self._index(item), item=item.model_dump()
            )
        )
        return events


def _input_details(usage: UsageInfo) -> InputTokensDetails:
    """Cached: the prompt tokens found in the prefix cache; written: the others, whose K/V this
    request computed into the paged cache."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return InputTokensDetails(cached_tokens=cached, cache_write_tokens=usage.prompt_tokens - cached)


# response.failed's error codes (OpenAI's list), by HTTP status; anything else is a server_error.
FAILURE_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


async def response_events(
    builder: ResponseBuilder, chunks: AsyncIterator[ChatCompletionChunk]
) -> AsyncIterator[dict[str, Any]]:
    """Every event of the response, the chat chunks consumed as they come."""
    for event in builder.start():
        yield event
    async with aclosing(chunks):
        async for chunk in chunks:
            for event in builder.add(chunk):
                yield event
    for event in builder.finish():
        yield event
