"""Engine settings: model, KV cache, scheduler and server configuration (pydantic, frozen).

Field names follow vLLM's (`max_num_seqs`, `block_size`, ...) so users' flags transfer. Names are
unique across sections, so a flat CLI flag or env var maps to exactly one section.
"""

from __future__ import annotations

import ipaddress
import json
import re
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.configs.json_object import parse_json_object
from pagedserve.configs.sampling import SamplingParams, SamplingParamsError
from pagedserve.configs.speculative import SpeculativeConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
ToolCallParserName = Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
# The generation_config fields that are sampling defaults (vLLM's set): SamplingParams' names,
# but for max_new_tokens, which is max_tokens (`sampling_name`).
GENERATION_CONFIG_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)


def sampling_name(name: str) -> str:
    """A generation_config field's SamplingParams name."""
    return "max_tokens" if name == "max_new_tokens" else name


def without_max_tokens(defaults: dict[str, float | int]) -> dict[str, float | int]:
    """The defaults a route passes to SamplingParams beside the max_tokens it resolves itself
    (from `defaults.get("max_tokens")` where the request left it out)."""
    return {name: value for name, value in defaults.items() if name != "max_tokens"}


def as_sampling_value(name: str, value: float | int) -> float | int:
    """A generation config's value as SamplingParams takes it: top_k 20.0 (JSON written by
    hand) is 20, as is max_new_tokens 20.0."""
    integral = name in ("top_k", "max_new_tokens")
    if integral and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": 1024,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
    "T": 10**12,
    "TB": 10**12,
    "TIB": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """Parse '512MiB', '2GB', '1048576' into a number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {text!r} (try '512MiB' or '2GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class ModelConfig(_Section):
    model: str = Field(
        DEFAULT_MODEL, description="HF model folder, hub id (offline), or the default model's name"
    )
    served_model_name: list[str] | None = Field(
        None,
        description="the names requests may give as `model` (vLLM's: the first is the one "
        "responses report; default: the model name)",
    )
    tokenizer: str | None = Field(None, description="tokenizer folder or id (default: the model's)")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template, or a file holding one, used instead of the "
        "tokenizer's (as vLLM's --chat-template; for models that ship none)",
    )
    # auto, as vLLM: bfloat16 where the hardware computes it natively (2x the float32 speed on an
    # AMX CPU), float32 elsewhere. --dtype float32 is the setting that is token-identical to HF.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights dtype (also the KV cache's, unless --kv-cache-dtype; auto: "
        "bfloat16 on CUDA and on CPUs with AVX512_BF16/AMX, float32 on other CPUs; float32 is "
        "token-identical to Hugging Face)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the model runs")
    # MKL (torch's F.linear) is what Hugging Face's nn.Linear runs; it picks kernels by CPU vendor:
    # on an AMD EPYC oneDNN ran the same float32 linears 1.2-4.3x faster, on Intel's Sapphire
    # Rapids 1.1-1.6x at 16-64 rows and level at prefill sizes (a few ulps apart).
    cpu_float32_linear: Literal["auto", "mkl", "onednn"] = Field(
        "auto",
        description="float32 linears on the CPU: mkl (torch's F.linear, as Hugging Face's), "
        "onednn (weights packed once for oneDNN), auto: onednn on x86 CPUs, mkl elsewhere",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="max prompt + output tokens (default: min(model limit, 4096))"
    )
    trust_remote_code: bool = Field(False, description="allow model code from the model folder")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="sampling defaults for fields a request omits: auto, the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM "
        "does; vllm, the API's own defaults",
    )
    seed: int = Field(0, ge=0, description="global seed for unseeded sampling")
    override_generation_config: dict[str, float | int] | None = Field(
        None,
        description='sampling defaults as JSON, e.g. {"temperature": 0.5} (vLLM\'s): over the '
        "model's generation config, or alone with --generation-config vllm; keys: "
        + ", ".join(GENERATION_CONFIG_FIELDS),
    )
    hf_overrides: dict[str, Any] | None = Field(
        None,
        description="values set on the model's Hugging Face config before it loads, as JSON "
        '(vLLM\'s), e.g. {"max_position_embeddings": 16384}',
    )
    max_logprobs: int = Field(
        20,
        ge=-1,
        description="most alternatives a request may ask for per token (logprobs, top_logprobs, "
        "prompt_logprobs, top_logprobs_num; vLLM's; -1: the whole vocabulary)",
    )
    enable_lora: bool = Field(False, description="serve LoRA adapters (vLLM's; see --lora-modules)")
    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapters as name=path (PEFT folders), with --enable-lora; a request "
        "runs one by naming it as its model",
    )
    max_lora_rank: int = Field(64, ge=1, description="largest adapter rank accepted")
    allow_runtime_lora_updating: bool = Field(
        False,
        description="with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(vLLM's, behind its VLLM_ALLOW_RUNTIME_LORA_UPDATING) load and unload adapters while "
        "serving; they read any folder the server can, so keep them behind --api-key",
    )

    # vLLM's parallelism settings, so its command lines start here: one process runs one model
    # on one device; more throughput comes from replicas (`pagedserve replicas N`).
    tensor_parallel_size: int = Field(1, description="1 only: one process runs the model (vLLM's)")
    pipeline_parallel_size: int = Field(1, description="1 only: one process runs every layer")
    data_parallel_size: int = Field(
        1, description="1 only: for data parallelism run `pagedserve replicas N`"
    )
    enforce_eager: bool = Field(
        False,
        description="accepted for vLLM's command lines: pagedserve always runs eagerly "
        "(it captures no graphs)",
    )

    @field_validator("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    @classmethod
    def _one_process(cls, value: int, info: Any) -> int:
        if value != 1:
            raise ValueError(
                f"{info.field_name} must be 1: pagedserve runs a model in one process on one "
                "device; for more throughput run replicas behind a router (pagedserve replicas N)"
            )
        return value

    @field_validator("override_generation_config", "hf_overrides", mode="before")
    @classmethod
    def _json_objects(cls, value: object, info: Any) -> object:
        return parse_json_object(value, info.field_name)

    @field_validator("override_generation_config")
    @classmethod
    def _sampling_defaults(cls, value: dict[str, float | int] | None) -> dict | None:
        unknown = sorted(set(value or {}) - set(GENERATION_CONFIG_FIELDS))
        if unknown:
            raise ValueError(
                f"override_generation_config: {', '.join(unknown)} not among "
                f"{', '.join(GENERATION_CONFIG_FIELDS)}"
            )
        if value is None:
            return None
        value = {name: as_sampling_value(name, setting) for name, setting in value.items()}
        try:  # out of range, every request leaving the field out would be refused
            SamplingParams(**{sampling_name(name): setting for name, setting in value.items()})
        except SamplingParamsError as error:
            raise ValueError(f"override_generation_config: {error}") from None
        return value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_lora_modules(cls, value: object) -> object:
        return value.split() if isinstance(value, str) else value  # PAGEDSERVE_LORA_MODULES

    @model_validator(mode="after")
    def _lora_modules_are_named_once(self) -> ModelConfig:
        if len(self.lora_adapters) != len(self.lora_modules):
            raise ValueError("lora_modules: each name once")
        if (self.lora_modules or self.allow_runtime_lora_updating) and not self.enable_lora:
            raise ValueError(
                "lora_modules and allow_runtime_lora_updating need enable_lora (--enable-lora)"
            )
        if set(self.served_model_names) & set(self.lora_adapters):
            raise ValueError("lora_modules: an adapter named as the served model is unreachable")
        return self

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # a YAML key or an env variable

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the model answers to; the first is the one responses report."""
        return tuple(self.served_model_name or [self.model])

    @property
    def lora_adapters(self) -> dict[str, str]:
        """name -> path of each adapter in `lora_modules` (raises on an entry without `=`)."""
        pairs = [entry.partition("=") for entry in self.lora_modules]
        if any(not name or not sep or not path for name, sep, path in pairs):
            raise ValueError("lora_modules: each entry is name=path")
        return {name: path for name, _, path in pairs}


class CacheConfig(_Section):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    kv_cache_memory: str = Field(
        "auto",
        description="KV cache budget on CPU (e.g. 512MiB, 2GiB; auto: a quarter of the memory "
        "available after the weights, at most 4GiB)",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="fraction of GPU memory for weights + KV on CUDA"
    )
    num_kv_blocks: int | None = Field(
        None,
        ge=1,
        description="explicit number of KV blocks (overrides the budget; default: from it)",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse cached KV blocks of identical prompt prefixes"
    )
    attention_backend: Literal["auto", "cpu", "triton", "torch"] = Field(
        "auto", description="paged attention kernel"
    )
    # Storage only: the CPU kernel computes in float32, Triton in the query's dtype. A smaller cache
    # dtype holds 2x (16-bit) or 4x (fp8) the tokens; speed barely changes on this CPU, where the
    # kernel is then compute-bound (benchmarks/RESULTS.md, "Roofline").
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description=(
            "KV cache storage dtype (auto: the model's; fp8 = fp8_e4m3, saturating at +-448)"
        ),
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _valid_size(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a plain byte count, as YAML or LLM(kv_cache_memory=2**30) give it
        if isinstance(value, str) and value.strip().lower() != "auto" and parse_bytes(value) < 1:
            raise ValueError(
                f"{value!r} holds no KV block: give a size such as '512MiB', or 'auto'"
            )
        return value


# The step budget the offline `LLM` uses unless given one. As vLLM-CPU (4096 offline, 2048 served),
# offline runs favour throughput: the peers workload (64 prompts of 32-512 tokens) ran 8-10%
# faster at 2048 than at 512 on a 2-core Zen 4, in fewer steps and without the tail of small
# decode batches that staggered prefills leave (benchmarks/RESULTS.md, sixteenth session). The
# server keeps 512: a burst of prompts prefilled in one 2048-token step doubled float32's TTFT p99
# at 1 request/s there.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


class SchedulerConfig(_Section):
    max_num_seqs: int = Field(64, ge=1, description="max requests in one step")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="token budget per step (chunked prefill beyond it)"
    )
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="most tokens of one prompt per step while other requests share the step, so "
        "a long prompt does not take every step's budget from short ones (vLLM's; 0: no cap)",
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="split prompts longer than a step's token budget into chunks (vLLM's; with "
        "--no-enable-chunked-prefill a prompt waits for a step that takes it whole, and "
        "--max-num-batched-tokens defaults to, and may not be below, max_model_len)",
    )
    max_waiting_requests: int = Field(
        1024,
        ge=1,
        description="requests in flight (waiting or running) beyond which new ones get 429",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description=(
            "order of waiting requests (priority: by each request's 'priority' field, lower first)"
        ),
    )
    # Only recompute: a victim's blocks are released and its tokens recomputed (cheap with the
    # prefix cache). Swap-to-host is not implemented; the flag exists so vLLM command lines parse.
    preemption_mode: Literal["recompute"] = Field(
        "recompute", description="what preemption does with a victim's KV"
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='n-gram speculative decoding as JSON, e.g. {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4} (off)',
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: object) -> object:
        return parse_json_object(value, "speculative_config")  # '' / 'null' / 'none': off

    def for_model_len(self, max_model_len: int) -> SchedulerConfig:
        """This config for a model of `max_model_len` positions. Without chunked prefill every
        prompt must fit one step, as vLLM has it: an unset step budget grows to max_model_len,
        and one set below it is refused (a longer prompt would wait forever).

        Raises:
            ValueError: chunked prefill off, and --max-num-batched-tokens below max_model_len.
        """
        if self.enable_chunked_prefill or self.max_num_batched_tokens >= max_model_len:
            return self
        if "max_num_batched_tokens" not in self.model_fields_set:
            return self.model_copy(update={"max_num_batched_tokens": max_model_len})
        raise ValueError(
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
            f"max_model_len ({max_model_len}): without chunked prefill no longer prompt could "
            "run. Raise --max-num-batched-tokens, lower --max-model-len, or leave chunked "
            "prefill on"
        )


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="bind port")
    uds: str | None = Field(
        None,
        description="listen on this Unix domain socket instead of --host and --port (vLLM's; "
        "for a proxy or sidecar on the same machine)",
    )
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer <key>' (default: none, no key asked)"
    )
    max_request_body_bytes: int = Field(
        1 << 20, ge=1024, description="largest accepted request body"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_requests: bool = Field(
        True,
        description="log one line per finished request (ids, token counts, finish reasons, "
        "latency; no text); vLLM's --enable-log-requests / --disable-log-requests also set it",
    )
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] | None = (
        Field(None, description="uvicorn's own log level (vLLM's; default: --log-level)")
    )
    uvicorn_access_log: bool = Field(
        True,
        description="log one line per HTTP request, uvicorn's access log; vLLM's "
        "--disable-uvicorn-access-log also clears it",
    )
    fastapi_docs: bool = Field(
        True,
        description="serve the API's schema and docs pages (/openapi.json, /docs, /redoc); "
        "vLLM's --disable-fastapi-docs also clears it",
    )
    log_stats: bool = Field(
        True,
        description="log a line of engine stats (throughput, running and waiting requests, KV "
        "cache usage, prefix-cache hit rate) every --log-stats-interval seconds while it works, "
        "as vLLM; vLLM's --disable-log-stats also clears it",
    )
    log_stats_interval: float = Field(
        10.0, gt=0, description="seconds between stats lines (vLLM's VLLM_LOG_STATS_INTERVAL)"
    )
    allowed_origins: str | None = Field(
        None,
        description="origins whose web pages may call the API from a browser (CORS), "
        "comma-separated or a JSON list as vLLM's, * for any (default: none; vLLM allows any)",
    )
    root_path: str = Field(
        "", description="the path prefix a proxy serves the API under (ASGI root_path)"
    )
    ssl_keyfile: str | None = Field(None, description="serve HTTPS with this private key file")
    ssl_certfile: str | None = Field(None, description="serve HTTPS with this certificate file")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="chat template variables for every request, as JSON (vLLM's), e.g. "
        '{"enable_thinking": false}; a request\'s own chat_template_kwargs win',
    )
    response_role: str = Field(
        "assistant",
        min_length=1,
        description="the role a chat reply names when the request adds a generation prompt "
        "(vLLM's; without one, the last message's role, whose text `echo` repeats)",
    )
    return_tokens_as_token_ids: bool = Field(
        False,
        description="name logprob tokens token_id:<id> for requests that leave "
        "return_tokens_as_token_ids out (vLLM's)",
    )
    enable_force_include_usage: bool = Field(
        False,
        description="end every stream with a usage chunk, as if it asked with "
        "stream_options.include_usage (vLLM's)",
    )
    enable_auto_tool_choice: bool = Field(
        False, description="let the model decide to call tools (tool_choice auto; as vLLM)"
    )
    tool_call_parser: ToolCallParserName | None = Field(
        None,
        description="how tool calls are read from free output (with auto tool choice; default: "
        "none, required with it)",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        description="return a thinking model's <think> part as the chat message's `reasoning` "
        "(as vLLM's; default: none, it stays in the content)",
    )
    responses_store_memory: str = Field(
        "256MiB",
        description="memory for responses kept for the Responses API's previous_response_id and "
        "GET /v1/responses/{id} (store: true, OpenAI's default), as their JSON; the least "
        "recently used are forgotten first; 0 keeps none (store is then answered false, as "
        "vLLM's default)",
    )

    @field_validator("responses_store_memory")
    @classmethod
    def _a_byte_size(cls, value: str) -> str:
        parse_bytes(value)  # raises, naming the value, if it is no size
        return value

    profiler_dir: str | None = Field(
        None,
        description="serve POST /start_profile and /stop_profile, which write torch.profiler "
        "traces of the engine's steps into this folder (vLLM's VLLM_TORCH_PROFILER_DIR; "
        "default: off)",
    )
    # The state lists request ids and block tables (no text): fine on a loopback bind, a choice to
    # make on a public one.
    enable_engine_state: bool | None = Field(
        None,
        description="serve GET /v1/engine/state and the /dashboard page "
        "(default: on when --host is a loopback address or with --uds)",
    )

    @property
    def engine_state_enabled(self) -> bool:
        if self.enable_engine_state is not None:
            return self.enable_engine_state
        return self.uds is not None or is_loopback_host(self.host)  # this machine's clients only

    @property
    def cors_origins(self) -> list[str]:
        return _origins(self.allowed_origins or "")

    @model_validator(mode="after")
    def _key_and_certificate_together(self) -> ServerConfig:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both ssl_keyfile and ssl_certfile")
        _origins(self.allowed_origins or "")  # a malformed list fails here, at start-up
        return self

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _json_object(cls, value: object) -> object:
        return parse_json_object(value, "default_chat_template_kwargs")

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_no_key(cls, value: str | None) -> str | None:
        # PAGEDSERVE_API_KEY="" would otherwise require the header "Bearer " that no client sends.
        return value if value and value.strip() else None

    @model_validator(mode="after")
    def _auto_tool_choice_needs_a_parser(self) -> ServerConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice needs tool_call_parser ("
                + ", ".join(typing.get_args(ToolCallParserName))
                + ")"
            )
        return self


def _origins(value: str) -> list[str]:
    """`a,b` or vLLM's `["a", "b"]`."""
    if value.strip().startswith("["):
        try:
            origins = json.loads(value)
        except RecursionError:
            origins = None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError("allowed_origins: a JSON list of origin strings")
        return [origin.strip() for origin in origins if origin.strip()]
    return [origin.strip() for origin in value.split(",") if origin.strip()]


class EngineConfig(_Section):
    """Everything the server and engine need; built by `configs.loader.load_engine_config`."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "server": ServerConfig,
}


def section_of(field_name: str) -> str:
    """The section that owns a flat field name (e.g. 'block_size' -> 'cache')."""
    for section, cls in SECTIONS.items():
        if field_name in cls.model_fields:
            return section
    raise KeyError(field_name)
