"""The Responses API's shapes (OpenAI's POST /v1/responses, as vLLM serves it): the request as a
client may send it, and the response object and output items the server answers with.

A request is checked here for its types only; server/responses.py turns it into a chat request,
whose checks (the chat route's) then apply, and refuses by name what it cannot serve.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedserve.server.protocol import ChatTokenLogprob, _Options

# What `include` may ask for (OpenAI's list). Only the logprobs change the answer here: the other
# entries name outputs of hosted tools (refused in `tools`) or encrypted reasoning, which this
# server does not produce (its reasoning comes back in plain text).
INCLUDABLE = frozenset(
    {
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)


class ContentPart(_Options):
    """A part of a message's content. Only text parts are read (input_text, output_text, refusal
    and text); the type is checked by server/responses.py, which names what it cannot read."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(_Options):
    """One item of `input`: a message (`type` "message" or absent, with `role` and `content`), an
    earlier function call (`function_call`: `call_id`, `name`, `arguments`), its result
    (`function_call_output`: `call_id`, `output`), or earlier reasoning (`reasoning`)."""

    type: str = "message"
    id: str | None = None  # an item's own id (an earlier response's output items carry theirs)
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class ResponsesTool(_Options):
    """A tool: `function` tools only (`name`, `description`, `parameters`, `strict`, flat, unlike
    chat's); hosted tools (web search, file search...) are refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Options):
    """`text.format`: `text` (the default), `json_object`, or `json_schema` with `name`,
    `schema`, `strict` and `description` flat (chat nests them under `json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Options):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # only the neutral value: others ask for more


class ReasoningConfig(_Options):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; none is written


class ResponsesRequest(_Options):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary, as vLLM's
    include: list[str] | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=1)  # caps hosted tools' calls: none are served
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    stream: bool = False
    store: bool = True  # kept in server/response_store.py (answered false without a store)
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's sampling extensions, passed on to the chat request as they are
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a --reasoning-parser's part out


# --- the answer -----------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, echoed as OpenAI does
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
