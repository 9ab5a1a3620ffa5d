"""SGLang's native `POST /generate` request (its `GenerateReqInput` and sampling parameters) as
pydantic models, and what turns one into the engine's `SamplingParams`.

Top-level keys SGLang has and these models do not declare are ignored, as SGLang ignores them
(sglang-router always sends `model`, `log_metrics`, `no_logs`...); those that ask for something
pagedserve cannot do (images, input embeddings, sessions, hidden states, disaggregation) are a
400 naming the field when set, and accepted at their neutral value. An unknown key inside
`sampling_params` is a 400, as in SGLang: a misspelt `max_new_token` must not silently produce
128 tokens.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedserve.configs import SamplingParams, StructuredOutputs
from pagedserve.configs.engine import without_max_tokens
from pagedserve.server.errors import invalid_request
from pagedserve.server.protocol import _Request, strings
from pagedserve.server.structured import structural_tag

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's

# Fields SGLang offers that pagedserve does not implement: accepted while they ask for nothing.
UNSUPPORTED_REQUEST_FIELDS = (
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "token_ids_logprob",
    "session_params",
    "session_id",
    "custom_logit_processor",
    "return_hidden_states",
    "return_bytes",
    "return_entropy",
    "return_routed_experts",
    "background",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)
UNSUPPORTED_SAMPLING_FIELDS = ("custom_params",)


class GenerateSamplingParams(BaseModel):
    """SGLang's `sampling_params` object. null means the default (the model's generation config,
    then SGLang's), except for `max_new_tokens`, where null asks for the rest of the context."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the stop string or stop token in the text
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream_interval: int | None = Field(None, ge=1)  # a chunk every this many tokens
    beam_width: int | None = None
    stop_regex: str | list[str] | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k == "max_new_tokens"}

    def constraint(self, index: int) -> StructuredOutputs | None:
        """The one output constraint (SGLang: an empty string is no constraint)."""
        kinds = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
        names = (*kinds, "structural_tag")
        found = [(name, getattr(self, name)) for name in names if getattr(self, name)]
        if len(found) > 1:
            raise invalid_request(
                "Only one of json_schema, regex, ebnf or structural_tag can be set.",
                sampling_param(index, found[1][0]),
            )
        if not found:
            return None
        name, spec = found[0]
        if name == "structural_tag":
            return structural_tag(sampling_param(index, name), spec)
        return StructuredOutputs(kinds[name], spec, sampling_param(index, name))  # type: ignore[arg-type]

    def check_supported(self, index: int) -> None:
        for name in UNSUPPORTED_SAMPLING_FIELDS:
            if getattr(self, name):
                raise invalid_request(f"{name} is not supported.", sampling_param(index, name))
        if self.beam_width not in (None, 1):
            raise invalid_request(
                "beam_width is not supported on /generate; the OpenAI routes take use_beam_search.",
                sampling_param(index, "beam_width"),
            )
        if not self.spaces_between_special_tokens:
            raise invalid_request(
                "spaces_between_special_tokens false is not supported.",
                sampling_param(index, "spaces_between_special_tokens"),
            )

    def to_sampling_params(self, **engine_fields: Any) -> SamplingParams:
        """`engine_fields`: what the route decides (max_tokens, logprobs, logit_bias...).
        Raises SamplingParamsError (a 400 naming the field) for out-of-range values."""
        sampled = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "frequency_penalty",
                "presence_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        return SamplingParams(
            **{**without_max_tokens(engine_fields.pop("defaults")), **sampled},
            n=self.n,
            min_tokens=self.min_new_tokens,
            stop=strings(self.stop),
            stop_regex=strings(self.stop_regex),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.no_stop_trim,
            # SGLang takes any signed 64-bit seed, the engine [0, 2**63): negative ones wrap
            seed=None if self.sampling_seed is None else self.sampling_seed % 2**63,
            **engine_fields,
        )


def sampling_param(index: int, name: str) -> str:
    """How errors name a sampling field: of the one object, or of a batch's `index`th (>= 0)."""
    return f"sampling_params[{index}].{name}" if index >= 0 else f"sampling_params.{name}"


class GenerateRequest(_Request):
    """SGLang's `GenerateReqInput`: one prompt (a string, or token ids), or a batch of them (a
    list of strings, or of token-id lists); the per-prompt fields take one value for all or a
    list with one value per prompt."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # Validated per prompt (`sampling`), so an error names the field a client got wrong.
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1  # -1: no prompt positions
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    lora_path: str | list[str | None] | None = None  # a served LoRA adapter's name
    priority: int | None = None  # SGLang's default order: a higher value is served first
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    token_ids_logprob: Any = None
    session_params: Any = None
    session_id: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = None
    return_bytes: Any = None
    return_entropy: Any = None
    return_routed_experts: Any = None
    background: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return not isinstance(self.text, str)
        return bool(self.input_ids) and not isinstance(self.input_ids[0], int)

    def check_supported(self) -> None:
        for name in UNSUPPORTED_REQUEST_FIELDS:
            if getattr(self, name) not in (None, False, [], {}):
                raise invalid_request(f"{name} is not supported by this server.", name)
        if (self.text is None) == (self.input_ids is None):
            raise invalid_request(
                "Either text or input_ids should be provided (one of them).", "text"
            )

    def sampling(self, count: int) -> list[GenerateSamplingParams]:
        """Each prompt's sampling parameters; a 400 naming the field that does not validate."""
        batched = isinstance(self.sampling_params, list)
        found = []
        for index, raw in enumerate(self.per_prompt("sampling_params", count)):
            try:
                found.append(GenerateSamplingParams.model_validate(raw or {}))
            except ValidationError as exc:
                error = exc.errors()[0]
                at = sampling_param(index if batched else -1, ".".join(map(str, error["loc"])))
                if error["type"] == "extra_forbidden":
                    known = ", ".join(GenerateSamplingParams.model_fields)
                    raise invalid_request(f"Unknown field {at} (known: {known}).", at) from None
                raise invalid_request(f"Invalid value for {at}: {error['msg']}.", at) from None
        return found

    def per_prompt(self, name: str, count: int) -> list[Any]:
        """Field `name` for each of `count` prompts: one value for all, or a list of `count`."""
        value = getattr(self, name)
        if not isinstance(value, list):
            return [value] * count
        if len(value) != count:
            raise invalid_request(
                f"{name} has {len(value)} entries for {count} prompts (give one value, or one "
                "per prompt).",
                name,
            )
        return value
