"""Turn request fields into engine input: tokenize prompts, apply the chat template, and check
everything the engine would reject (vocabulary, context length) before anything is queued.

Tokenization runs on the event loop on purpose: HF fast tokenizers are not safe to share between
threads ("Already borrowed"), and one prompt takes well under a millisecond per kilobyte.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from jinja2 import TemplateError

from pagedserve.configs.sampling import MAX_STOP_SEQUENCE_CHARS, MAX_STOP_SEQUENCES
from pagedserve.engine.client import EngineClient
from pagedserve.server.errors import invalid_request, model_not_found
from pagedserve.server.protocol import ChatMessage
from pagedserve.server.tools import template_messages


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str  # as given, or decoded from the ids (what `echo` returns)


def check_model(requested: str | None, engine: EngineClient) -> str | None:
    """Raises 404 unless the request names the served model, one of the LoRA adapters it serves
    (engine/lora.py), or none; returns that adapter's name (None: the base model)."""
    if requested is None or requested in engine.served_model_names:
        return None
    if requested in engine.lora_adapters:
        return requested
    raise model_not_found(requested)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"Token id {token_id} is out of vocabulary (valid ids are 0..{vocab_size - 1}).",
                param,
            )


def check_unicode(text: str, param: str) -> None:
    """A 400 for text that is not valid Unicode (a lone surrogate), which no tokenizer reads."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_request(
            "The text is not valid Unicode (it contains a lone surrogate).", param
        ) from None


def encode_text(
    engine: EngineClient, text: str, param: str, add_special_tokens: bool = True
) -> list[int]:
    """Tokenize user text (check_unicode first)."""
    check_unicode(text, param)
    return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
    engine: EngineClient,
    add_special_tokens: bool = True,
    param: str = "prompt",
) -> list[Prompt]:
    """One `Prompt` per prompt of a /v1/completions request (or input of /v1/embeddings: `param`
    names the field); empty prompts are rejected. Text prompts get the tokenizer's special
    tokens (BOS...) unless `add_special_tokens` is false."""
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if items and isinstance(items[0], int):
        items = [items]  # a single prompt given as token ids
    empty = f"The {param} must not be empty."
    if not items:
        raise invalid_request(empty, param)
    if len(items) > engine.max_waiting_requests:  # each prompt is one engine request
        raise invalid_request(
            f"At most {engine.max_waiting_requests} {param}s fit in one request (the server's "
            f"max_waiting_requests); got {len(items)}.",
            param,
        )
    prompts = []
    for item in items:
        if not item:
            raise invalid_request(empty, param)
        if isinstance(item, str):
            token_ids = encode_text(engine, item, param, add_special_tokens)
            if not token_ids:  # e.g. whitespace a tokenizer drops, without special tokens
                raise invalid_request(empty, param)
            prompts.append(Prompt(token_ids, item))
        else:
            check_token_ids(item, engine.vocab_size, param)
            prompts.append(Prompt(list(item), engine.tokenizer.decode(item)))
    return prompts


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How a chat request asks its template to be rendered (vLLM's fields of the same names)."""

    add_generation_prompt: bool = True  # open the assistant's turn
    continue_final_message: bool = False  # leave the last message open, to be continued
    kwargs: dict[str, Any] = field(default_factory=dict)  # the template's own variables
    add_special_tokens: bool = False  # the template writes its special tokens itself


def template_kwargs(request: Request, requested: dict[str, Any] | None) -> dict[str, Any]:
    """A chat request's template variables: the server's --default-chat-template-kwargs with the
    request's own chat_template_kwargs over them (vLLM's precedence)."""
    defaults = request.app.state.config.server.default_chat_template_kwargs or {}
    # As vLLM's merge: a request's null or "auto" leaves the server's value in place.
    chosen = {
        name: value for name, value in (requested or {}).items() if value not in (None, "auto")
    }
    return {**defaults, **chosen}


def check_default_template_kwargs(tokenizer: Any, defaults: dict[str, Any] | None) -> None:
    """At start-up: --default-chat-template-kwargs may not name what every request's would be
    refused for (otherwise each chat request would fail blaming its own chat_template_kwargs)."""
    reserved = sorted(_template_call_names(tokenizer).intersection(defaults or {}))
    if reserved:
        raise ValueError(
            f"default_chat_template_kwargs may not set {', '.join(reserved)}: they are how the "
            "template is applied, not variables of it"
        )


def chat_prompt(
    messages: list[ChatMessage],
    engine: EngineClient,
    tools: list[dict[str, Any]] | None = None,
    options: TemplateOptions | None = None,
) -> Prompt:
    """Render the model's chat template and tokenize it (by default with the assistant's turn
    opened). With `tools`, the template's `tools` argument, or the fallback block if the
    template ignores it."""
    options = options or TemplateOptions()
    _check_template_options(options, engine.tokenizer)
    try:
        renders_tools = bool(tools) and _renders_tools(engine.tokenizer, tools or [])
        conversation = template_messages(messages, tools or [], renders_tools)
        extra = {"tools": tools} if renders_tools else {}
        if options.continue_final_message:  # passed only when asked: not every template API has it
            extra["continue_final_message"] = True
        text = _render(engine.tokenizer, conversation, options, extra)
    except (ValueError, TemplateError) as exc:  # no template, or it rejects the conversation
        # (templates refuse e.g. a system role or turns that do not alternate by raising)
        raise invalid_request(f"Cannot apply the chat template: {exc}", "messages") from exc
    token_ids = encode_text(engine, text, "messages", options.add_special_tokens)
    if not token_ids:
        raise invalid_request("The chat template rendered an empty prompt.", "messages")
    return Prompt(token_ids, text)


def _render(
    tokenizer: Any, conversation: list[dict[str, Any]], options: TemplateOptions, extra: dict
) -> str:
    try:
        text: str = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=options.add_generation_prompt,
            tokenize=False,
            **options.kwargs,
            **extra,
        )
        return text
    except TypeError as exc:  # a variable the template cannot take (or misuses)
        if not options.kwargs:
            raise
        raise invalid_request(
            f"Cannot apply the chat template with these variables: {exc}", "chat_template_kwargs"
        ) from exc


# Names a template variable may not take: the arguments of apply_chat_template (read from the
# tokenizer's own signature, so a newer transformers' are covered too) and the names transformers
# renders the template with (`messages`...), which would change how the template is applied, or
# fail as a duplicate keyword, rather than set a variable of it.
_TEMPLATE_RENDER_NAMES = frozenset(
    ["self", "kwargs", "conversation", "conversations", "messages", "tools", "documents"]
)


def _template_call_names(tokenizer: Any) -> frozenset[str]:
    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):  # no signature to read
        parameters = {}
    return _TEMPLATE_RENDER_NAMES.union(parameters)


def _check_template_options(options: TemplateOptions, tokenizer: Any) -> None:
    if options.continue_final_message and options.add_generation_prompt:
        raise invalid_request(
            "continue_final_message needs add_generation_prompt false: the last message is "
            "continued, no new turn is opened.",
            "continue_final_message",
        )
    reserved = sorted(_template_call_names(tokenizer).intersection(options.kwargs))
    if reserved:
        raise invalid_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: use the request's own "
            "fields for how the template is applied.",
            "chat_template_kwargs",
        )


def _renders_tools(tokenizer: Any, tools: list[dict[str, Any]]) -> bool:
    """Whether the template writes `tools` into the prompt (many, like SmolLM2's, ignore it)."""
    probe = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    with_tools = tokenizer.apply_chat_template(
        probe, add_generation_prompt=True, tokenize=False, tools=tools
    )
    return bool(with_tools != plain)


def truncated(
    prompt: Prompt,
    keep: int | None,
    engine: EngineClient,
    side: str = "left",
    longest: int | None = None,
) -> Prompt:
    """The prompt cut to `keep` tokens (vLLM's truncate_prompt_tokens; -1: `longest`, by default
    the model's context length; None: all of it): its last ones (`side` "left", what generation
    keeps) or its first ("right"). A cut prompt's text is its tokens' (what `echo` returns)."""
    if keep is None:
        return prompt
    if keep == 0:
        raise invalid_request(
            "truncate_prompt_tokens must be at least 1 (or -1 for the context length).",
            "truncate_prompt_tokens",
        )
    keep = (longest or engine.max_model_len) if keep == -1 else keep
    if len(prompt.token_ids) <= keep:
        return prompt
    token_ids = prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep]
    return Prompt(token_ids, engine.tokenizer.decode(token_ids))


def bad_words_token_ids(
    words: list[str] | None, engine: EngineClient
) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words`: each word as written and, where that makes other
    tokens of the same count, after a space (mid-sentence, as a byte-level BPE spells it)."""
    if len(words or []) > MAX_STOP_SEQUENCES:
        raise invalid_request(f"At most {MAX_STOP_SEQUENCES} bad_words.", "bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in words or []:
        if not word.strip() or len(word) > MAX_STOP_SEQUENCE_CHARS:
            raise invalid_request(
                f"Each of bad_words must be 1-{MAX_STOP_SEQUENCE_CHARS} characters, not blank.",
                "bad_words",
            )
        plain = tuple(encode_text(engine, word.lstrip(), "bad_words", add_special_tokens=False))
        spaced = tuple(encode_text(engine, " " + word.lstrip(), "bad_words", False))
        if not plain:  # a tokenizer that drops it (its normalizer)
            raise invalid_request(f"bad_words: {word!r} has no tokens.", "bad_words")
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(sequences)


def resolve_max_tokens(
    requested: int | None,
    default: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
) -> int:
    """The max_tokens to run with. Absent: `default` capped at the remaining context (the whole
    remaining context when `default` is None). Raises 400 when the context cannot fit."""
    num_remaining_tokens = max_model_len - num_prompt_tokens
    if num_remaining_tokens < 1:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion.",
            prompt_param,
        )
    if requested is None:
        return num_remaining_tokens if default is None else min(default, num_remaining_tokens)
    if requested > num_remaining_tokens:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion). Reduce the prompt or {max_tokens_param}.",
            max_tokens_param,
        )
    return requested


def parse_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    parsed = {}
    for key, bias in (logit_bias or {}).items():
        # ASCII digits only: str.isdigit() also accepts "²" or "٣", which int() rejects or reads
        # as another number; and a bounded length, as Python refuses to parse huge integers.
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            raise invalid_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias")
        parsed[int(key)] = bias
    check_token_ids(list(parsed), vocab_size, "logit_bias")
    return parsed
