"""What the engine hands back: incremental per-choice deltas (`RequestDelta`) for streaming, and
vLLM-shaped `RequestOutput` / `CompletionOutput` for the offline `LLM` API; plus `EngineStats`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the `top` best alternatives (best first)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 = the most likely token; set for prompt tokens


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Engine-side timestamps of one request (time.monotonic()), sent with its final delta."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one choice of one request produced in one engine step (streaming unit).

    `new_text` never ends inside a UTF-8 character and never contains (the start of) a stop
    string that might still match; such text is held back until it is safe to emit.
    """

    request_id: str
    index: int  # choice index, 0..n-1
    new_token_ids: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[TokenLogprob, ...] | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, this choice
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (final)
    num_cached_prompt_tokens: int = 0
    timings: RequestTimings | None = None  # set on the final delta of the request's last choice
    # With prompt logprobs: one entry per prompt token (None for the first), on the choice's
    # first delta only.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # SamplingParams.embed: the final hidden state of the prompt's last token, on the final delta
    embedding: tuple[float, ...] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One finished choice (offline API, vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class RequestOutput:
    """One finished request with all of its choices (offline API, vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ClassificationOutput:
    """One prompt's class probabilities (offline API; vLLM's `probs`), best label and logits."""

    probs: list[float]
    label: str
    logits: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """One pair's score (offline API, vLLM's shape: `output.outputs.score`)."""

    prompt_token_ids: list[int]
    outputs: ScoringOutput


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One prompt's embedding (offline API, vLLM's shape: `output.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /metrics; counters are cumulative since start."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 0
    cache_dtype: str = ""  # the KV cache's storage dtype, e.g. "float32" or "fp8_e4m3"
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens prefilled: each choice's, counted at its first token
    num_prefilled_tokens: int = 0  # prompt tokens computed (no prefix-cache hits; recomputes too)
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_steps: int = 0
    num_structured_requests: int = 0  # requests admitted with an output constraint
    # speculative decoding (all zero when off): verified steps with drafts, drafted tokens,
    # accepted drafts, and acceptances by draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_per_position: tuple[int, ...] = ()
