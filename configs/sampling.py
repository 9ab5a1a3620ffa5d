"""`SamplingParams`: one request's decoding settings, validated at construction.

Lives in `configs/` because the server, the engine and the scheduler all read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pagedserve.configs.stop_regex import MAX_STOP_REGEX_CHARS, StopRegexError, stop_pattern

GREEDY_TEMPERATURE = 1e-5  # temperatures below it sample greedily
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256
MAX_N = 16
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_CONSTRAINT_CHARS = 1_000_000  # a longer schema or grammar is refused, not compiled


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise SamplingParamsError(param, message)


def _check_strings(values: tuple[str, ...], param: str, what: str, max_chars: int) -> None:
    """At most MAX_STOP_SEQUENCES non-empty strings of at most `max_chars` characters each."""
    _check(
        len(values) <= MAX_STOP_SEQUENCES,
        param,
        f"at most {MAX_STOP_SEQUENCES} {what}s, got {len(values)}",
    )
    for value in values:
        _check(
            isinstance(value, str) and 0 < len(value) <= max_chars,
            param,
            f"each {what} must be a non-empty string of at most {max_chars} characters",
        )


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class ThinkBlock:
    """A reasoning model's think block (`<think>` ... `</think>`, each tag one token), which an
    output constraint leaves free, as vLLM's and SGLang's structured outputs do under a
    `--reasoning-parser`: the model reasons in free text, and the grammar applies from the token
    after `close_token_id`. `inside`: the reply starts inside the block (the prompt opened it);
    otherwise its first token, and only its first, may open the block."""

    open_token_id: int
    close_token_id: int
    inside: bool = False

    def __post_init__(self) -> None:
        ids = (self.open_token_id, self.close_token_id)
        _check(
            all(isinstance(t, int) and t >= 0 for t in ids) and ids[0] != ids[1],
            "structured_outputs",
            "a think block's tags must be two different token ids >= 0",
        )


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A decoding constraint, as vLLM's `structured_outputs` names its kinds. `spec` is the JSON
    schema text (json), the regex, the EBNF grammar, the tuple of choices, the structural tag's
    JSON (engine/structured_outputs/structural_tag.py), or "" (json_object: any JSON object).
    The engine compiles it; equal constraints compile once, so `param` (the request field that
    carried it, named in errors) and `think` (where the reply may reason first, outside the
    grammar) are not part of the identity."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
    spec: str | tuple[str, ...] = ""
    param: str = field(default="structured_outputs", compare=False)
    think: ThinkBlock | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check(self.kind in CONSTRAINT_KINDS, self.param, f"unknown constraint {self.kind!r}")
        if self.kind == "choice":
            _check(
                isinstance(self.spec, tuple)
                and bool(self.spec)
                and all(isinstance(choice, str) for choice in self.spec),
                self.param,
                "choice must be a non-empty list of strings",
            )
            num_chars = sum(len(choice) for choice in self.spec)
        else:
            _check(isinstance(self.spec, str), self.param, f"{self.kind} must be a string")
            _check(
                self.kind == "json_object" or bool(self.spec),
                self.param,
                f"{self.kind} must not be empty",
            )
            num_chars = len(self.spec)
        _check(
            num_chars <= MAX_CONSTRAINT_CHARS,
            self.param,
            f"the constraint is longer than {MAX_CONSTRAINT_CHARS} characters",
        )
        _check(
            self.think is None or isinstance(self.think, ThinkBlock),
            self.param,
            "think must be a ThinkBlock",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Immutable; invalid values raise."""

    n: int = 1
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    # Patterns that end the output where its text first matches one (SGLang's stop_regex;
    # configs/stop_regex.py): cut there, as at a stop string.
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: any)
    # Token sequences never to complete: a sequence's last token is banned wherever the output
    # ends with the rest of it (vLLM's bad_words, as the server tokenizes them).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Prefix-cache isolation: only requests with the same salt share cached blocks (vLLM's).
    cache_salt: str | None = None
    ignore_eos: bool = False
    logprobs: int | None = (
        None  # number of top alternatives to return per token (0 = only the chosen)
    )
    # Logprobs of the prompt's own tokens (the first has none), with this many top alternatives
    # per position; None computes none. The whole prompt then runs: a cached prefix has no logits.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # leave special tokens (<|im_end|>...) out of the text
    structured_outputs: StructuredOutputs | None = None  # constrained decoding (None: free)
    lora: str | None = None  # the LoRA adapter to run, by its name (--lora-modules); None: base
    # Return the final hidden state of the prompt's last token with the final delta (an
    # embedding, engine/embeddings.py): a request of one choice and one token, which is dropped.
    embed: bool = False

    def __post_init__(self) -> None:
        _check(
            isinstance(self.n, int) and 1 <= self.n <= MAX_N,
            "n",
            f"n must be in [1, {MAX_N}], got {self.n}",
        )
        _check(
            _finite(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            f"temperature must be a finite number in [0, 100], got {self.temperature}",
        )
        _check(
            _finite(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"top_p must be in (0, 1], got {self.top_p}",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}",
        )
        _check(
            _finite(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"min_p must be in [0, 1], got {self.min_p}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _finite(value) and -2.0 <= value <= 2.0,
                name,
                f"{name} must be in [-2, 2], got {value}",
            )
        _check(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
        )
        for token_id, bias in self.logit_bias.items():
            _check(
                isinstance(token_id, int) and token_id >= 0,
                "logit_bias",
                f"logit_bias keys must be token ids >= 0, got {token_id!r}",
            )
            _check(
                _finite(bias) and -100.0 <= bias <= 100.0,
                "logit_bias",
                f"logit_bias values must be in [-100, 100], got {bias}",
            )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            f"seed must be in [0, 2**63), got {self.seed}",
        )
        _check(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            f"prompt_logprobs must be at least 0, got {self.prompt_logprobs}",
        )
        # 0: the request ends right after its prefill, with no output token (its prompt
        # logprobs are the answer, or it only fills the prefix cache: SGLang's warm-up).
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 0,
            "max_tokens",
            f"max_tokens must be at least 0, got {self.max_tokens}",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
        )
        _check_strings(self.stop, "stop", "stop sequence", MAX_STOP_SEQUENCE_CHARS)
        _check_strings(self.stop_regex, "stop_regex", "stop pattern", MAX_STOP_REGEX_CHARS)
        for pattern in self.stop_regex:
            try:
                stop_pattern(pattern)  # compiled once: the detokenizer takes it from the cache
            except StopRegexError as exc:
                raise SamplingParamsError("stop_regex", str(exc)) from None
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be token ids >= 0",
        )
        _check(
            len(self.bad_words_token_ids) <= 2 * MAX_STOP_SEQUENCES
            and all(
                len(word) > 0 and all(isinstance(t, int) and t >= 0 for t in word)
                for word in self.bad_words_token_ids
            ),
            "bad_words",
            f"at most {MAX_STOP_SEQUENCES} bad words, each some token ids >= 0",
        )
        _check(
            self.cache_salt is None
            or (isinstance(self.cache_salt, str) and len(self.cache_salt) > 0),
            "cache_salt",
            "cache_salt must be a non-empty string",
        )
        _check(
            self.allowed_token_ids is None
            or (
                len(self.allowed_token_ids) > 0
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)
            ),
            "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of token ids >= 0",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            "logprobs",
            f"logprobs must be at least 0, got {self.logprobs}",
        )
        _check(
            self.lora is None or (isinstance(self.lora, str) and len(self.lora) > 0),
            "lora",
            "lora must be an adapter's name",
        )
        _check(
            not self.embed or (self.n == 1 and self.max_tokens == 1),
            "embed",
            "an embedding request has one choice (n 1) and one token (max_tokens 1)",
        )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            "structured_outputs must be a StructuredOutputs",
        )

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 to inf and the softmax to NaN; such a
        # temperature means greedy anyway (vLLM uses the same threshold).
        return self.temperature < GREEDY_TEMPERATURE
