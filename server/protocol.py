"""OpenAI-compatible request and response models (pydantic v2), with vLLM's sampling extensions.

Requests validate types strictly (`"5"` is not an int), so a wrong type is a 400, never a silent
coercion. The two generation requests, and their option objects (`stream_options`,
`response_format`, `structured_outputs`), keep the keys they do not declare, for
server/request_fields.py to judge: parameters vLLM implements and we do not are a 400 when they
ask for something, other keys are ignored (as vLLM does) and logged, so clients written for newer
OpenAI versions or other servers keep working. Other nested objects (messages, tools) ignore
unknown keys. Ranges of sampling values are checked once, by `SamplingParams`, not repeated here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedserve.configs import SamplingParams, StructuredOutputs
from pagedserve.configs.engine import without_max_tokens
from pagedserve.server.tool_protocol import (
    NamedToolChoice,
    RequestToolCall,
    ToolCall,
    ToolCallDelta,
    ToolDefinition,
)


def strings(value: str | list[str] | None) -> tuple[str, ...]:
    """A field that takes one string or a list of them (`stop`, `stop_regex`), as a tuple."""
    return (value,) if isinstance(value, str) else tuple(value or ())


class _Request(BaseModel):
    # extra="ignore": see the module docstring; strict: no type coercion.
    model_config = ConfigDict(extra="ignore", strict=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's schema makes optional fields nullable (`"stream": null`, `"echo": null`...):
        null asks for the default. A required field stays required, null or not."""
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None
            or key not in cls.model_fields
            or cls.model_fields[key].is_required()
        }


class _Options(_Request):
    # Undeclared keys are kept (model_extra) for server/request_fields.py.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Options):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> StreamOptions:
        # vLLM ignores it alone; asked for, it would then be answered without any usage.
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage")
        return self


class JsonSchemaFormat(_Options):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Options):
    # text | json_object | json_schema | structural_tag; others are a 400 naming response_format
    type: str
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (vLLM's): xgrammar's format tree, or the original structures and triggers
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsField(_Options):
    """vLLM's `structured_outputs` request object (one of its fields; see server/structured.py)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None  # vLLM's: a structural tag's JSON


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (null means the default)."""

    # Undeclared keys are kept (model_extra) for server/request_fields.py.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's: the output ends at a pattern's match
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = Field(None, max_length=1024)  # vLLM's prefix-cache isolation
    # vLLM's: keep only the prompt's last k tokens (-1: the model's context length)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's token tracing: the prompt's and each choice's token ids beside the text, and logprob
    # tokens named "token_id:<id>" (server/token_bytes.py)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: --return-tokens-as-token-ids
    priority: int = 0  # with --scheduling-policy priority: lower is served first (as vLLM)
    # vLLM's beam search (server/beam_search.py): n is the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Output constraints: OpenAI's, vLLM's, and vLLM's older guided_* (server/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: Any, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream"):  # as OpenAI and vLLM
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether logprob tokens are named "token_id:<id>": the request's choice, else the
        server's --return-tokens-as-token-ids (vLLM's precedence)."""
        asked = self.return_tokens_as_token_ids
        return server_default if asked is None else asked

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: each chunk carries its choice's usage so far."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def to_sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        logit_bias: dict[int, float],
        structured_outputs: StructuredOutputs | None = None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, float | int] | None = None,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
        lora: str | None = None,
    ) -> SamplingParams:
        """Raises SamplingParamsError (naming the field) for out-of-range values. A field the
        request leaves out takes `defaults` (the model's, engine/sampling_defaults.py), else
        SamplingParams' own."""
        requested = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        set_here = {k: v for k, v in requested.items() if v is not None}
        optional = {**without_max_tokens(defaults or {}), **set_here}
        return SamplingParams(
            **{name: value for name, value in optional.items() if value is not None},
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=strings(self.stop),
            stop_regex=strings(self.stop_regex),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            bad_words_token_ids=bad_words_token_ids,
            cache_salt=self.cache_salt,
            allowed_token_ids=None
            if self.allowed_token_ids is None
            else tuple(self.allowed_token_ids),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias,
            logprobs=logprobs,
            structured_outputs=structured_outputs,
            prompt_logprobs=prompt_logprobs,
            lora=lora,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's cap is 5, vLLM's --max-logprobs 20; -1: the whole vocabulary (vLLM's)
    logprobs: int | None = Field(None, ge=-1)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM's extension (-1 as logprobs)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (...) around a text prompt


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[RequestToolCall] | None = None  # assistant turns (see server/tools.py)
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # After tool_calls: its check reads them. None only beside an assistant's tool_calls.
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and not (
            info.data.get("role") == "assistant" and info.data.get("tool_calls")
        ):
            raise ValueError("Field required (only an assistant's tool_calls may replace it)")
        return content

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def to_template_message(self) -> dict[str, str]:
        """The dict a chat template expects; `developer` is OpenAI's newer name for `system`.
        A participant's `name` goes along, for templates that render it."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM's extension (-1 as top_logprobs)
    # vLLM's chat template controls: open the assistant's turn, or continue the last message
    # (an assistant prefill); variables for the template (e.g. Qwen3's enable_thinking); and
    # special tokens added around the rendered text (the template has its own).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # vLLM's: the reply starts with the last message's text when it is the assistant's (a
    # prefill continued with continue_final_message), and the rendered prompt comes back.
    echo: bool = False
    return_prompt_text: bool = False
    include_reasoning: bool = True  # vLLM's: false leaves a --reasoning-parser's part out


class TokenizeRequest(_Options):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    # With messages, chat's template controls and tools (ChatCompletionRequest), so counts
    # match chat's.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False  # vLLM's: each token's vocabulary entry as well


class DetokenizeRequest(_Options):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Request):  # vLLM's, with --allow-runtime-lora-updating
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name (its running requests keep it)


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


# --- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


# The lowest logprob a response shows: a token the constraint (or top-k) ruled out has -inf,
# which JSON cannot carry; vLLM's server writes -9999.0 for it too.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # -inf (and NaN) become the floor


# Every logprob field serialises through this, so values appended after validation are covered.
Logprob = Annotated[float, PlainSerializer(finite_logprob, return_type=float)]


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy (completions) logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt logprobs entry, keyed by token id: the prompt's token and its alternatives."""

    logprob: Logprob
    rank: int | None = None  # 1 = the most likely token at that position
    decoded_token: str


# One per prompt token, None for the first (nothing precedes it), as vLLM's `prompt_logprobs`.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


_ON_REQUEST = ("prompt_logprobs", "prompt_token_ids", "token_ids", "prompt_text", "token_strs")


def _drop_unasked(data: dict[str, Any], keys: tuple[str, ...] = _ON_REQUEST) -> dict[str, Any]:
    # vLLM's extensions appear only when asked for, so OpenAI-shaped bodies stay exactly so.
    for key in keys:
        if key in data and data[key] is None:
            del data[key]
    return data


def _with_finish(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `stop_reason` (the stop string or stop token id that ended the choice; null for EOS,
    the length or an abort) rides with a choice's `finish_reason`: on final choices only."""
    if data.get("finish_reason") is None:
        data.pop("stop_reason", None)
    return _drop_unasked(data)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # return_token_ids (vLLM puts the prompt's on each choice here, on its first chunk when
    # streaming; a chunk's token_ids are the ones it adds)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _with_finish(handler(self))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # --response-role (vLLM's)
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # vLLM's, with a --reasoning-parser (server/reasoning.py)

    @model_serializer(mode="wrap")
    def _when_present(self, handler: Any) -> dict[str, Any]:
        return _drop_unasked(handler(self), ("tool_calls", "reasoning"))


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _with_finish(handler(self))


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_text: str | None = None  # return_prompt_text: the chat template's output

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _drop_unasked(handler(self))


class ChatDelta(BaseModel):
    role: str | None = None  # the first chunk's: --response-role (vLLM's)
    content: str | None = None
    reasoning: str | None = None  # vLLM's, with a --reasoning-parser
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: `{"role": ...}` first, then `{"content": ...}`.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the ones this chunk adds

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _with_finish(handler(self))


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on each choice's first chunk
    prompt_text: str | None = None  # return_prompt_text: on each choice's first chunk

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _drop_unasked(handler(self))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # return_token_strs

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _drop_unasked(handler(self))


class DetokenizeResponse(BaseModel):
    prompt: str
