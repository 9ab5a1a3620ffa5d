"""POST /v1/embeddings (OpenAI's and vLLM's shape): each input's embedding, the final hidden state
of its last token (engine/embeddings.py), L2-normalised unless `normalize` is false (vLLM's), and
cut to its first `dimensions` (then normalised again) for Matryoshka-trained models.

Each input is an engine request of one token batched with everything else: the same paged
cache, prefix cache and scheduler as generation. Inputs are strings or token ids; an input may
hold at most the context length less one token (the one token the engine samples and drops).
"""

from __future__ import annotations

import base64
import sys
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fastapi import APIRouter, Request
from pydantic import Field

from pagedserve.configs import SamplingParams
from pagedserve.engine.embeddings import normalized
from pagedserve.engine.errors import RequestFailedError
from pagedserve.server.errors import APIError, invalid_request
from pagedserve.server.generation import EngineInput, start_generation
from pagedserve.server.prompts import (
    Prompt,
    TemplateOptions,
    chat_prompt,
    check_model,
    completion_prompts,
    template_kwargs,
    truncated,
)
from pagedserve.server.protocol import ChatMessage, _Options
from pagedserve.server.recorder import RequestRecorder
from pagedserve.server.request_fields import check_request_fields

router = APIRouter()


class PoolingInputs(_Options):
    """What a pooling request (embeddings, classification) runs: `input` as text or token ids, or
    vLLM's chat-style `messages`, a conversation (or several) rendered by the chat template."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: true for input, false for messages


class EmbeddingRequest(PoolingInputs):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's: the activation (for embeddings, the L2 normalisation; `normalize` before 0.32)
    use_activation: bool | None = None
    normalize: bool | None = None
    # vLLM's base64 encoding: the values' dtype and byte order
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    # vLLM's: cut the input to this many tokens (-1: the most an input may hold), from which side
    # (default: the tokenizer's); padding is not done
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    padding: Literal["do_not_pad"] | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, max_length=1024)

    @property
    def normalizes(self) -> bool:
        chosen = self.use_activation if self.use_activation is not None else self.normalize
        return chosen is not False


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    lora = check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    prompts = truncated_inputs(
        input_prompts(body, request), body.truncate_prompt_tokens, body.truncation_side, engine
    )
    options = EmbeddingOptions(lora, body.priority, body.cache_salt)
    vectors = await embed_prompts(request, prompts, options)
    num_prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
    return {
        "id": f"embd-{request.state.request_id}",
        "object": "list",
        "created": request.state.created,
        "model": lora or engine.model_name,
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(_shaped(vector, body), body),
            }
            for index, vector in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


def truncation(engine: Any, side: str | None) -> tuple[str, int]:
    """The side truncation cuts from (the one asked for, else the tokenizer's) and the most
    tokens an input may keep: the context less the one token the engine samples and drops."""
    return side or getattr(engine.tokenizer, "truncation_side", "right"), engine.max_model_len - 1


def truncated_inputs(
    prompts: list[Prompt], limit: int | None, side: str | None, engine: Any
) -> list[Prompt]:
    """Each input cut to truncate_prompt_tokens (`limit`; -1: the most an input may keep)."""
    side, longest = truncation(engine, side)
    return [truncated(prompt, limit, engine, side, longest) for prompt in prompts]


@dataclass(frozen=True, slots=True)
class EmbeddingOptions:
    lora: str | None = None  # the adapter the request's model names
    priority: int = 0
    cache_salt: str | None = None


async def embed_prompts(
    request: Request, prompts: list[Prompt], options: EmbeddingOptions
) -> list[tuple[float, ...]]:
    """Each prompt's final hidden state (not normalised), all run in the engine at once: one
    one-token request each (engine/embeddings.py). Raises a 400 for a prompt with no room."""
    longest = request.app.state.engine.max_model_len - 1  # room for the token it samples
    for index, prompt in enumerate(prompts):
        if len(prompt.token_ids) > longest:
            raise invalid_request(
                f"Input {index} has {len(prompt.token_ids)} tokens; this model embeds at most "
                f"{longest} (its context length less one; truncate_prompt_tokens -1 cuts to it).",
                "input",
            )
    params = SamplingParams(
        max_tokens=1, temperature=0.0, embed=True, lora=options.lora, cache_salt=options.cache_salt
    )
    inputs = [EngineInput(prompt.token_ids, params, options.priority) for prompt in prompts]
    recorder = RequestRecorder.of(request, [len(prompt.token_ids) for prompt in prompts], 1)
    stream = await start_generation(request, inputs, recorder)
    vectors: dict[int, tuple[float, ...]] = {}
    async with aclosing(stream):
        async for prompt_index, delta in stream:
            if delta.finished:
                if delta.finish_reason == "abort":  # /abort_request, or the engine stopping
                    raise APIError(
                        503,
                        "The request was aborted before its embedding was computed.",
                        "server_error",
                        code="aborted",
                    )
                if delta.embedding is None:  # cannot happen: every embed request ends with one
                    raise RequestFailedError("The engine returned no embedding.")
                vectors[prompt_index] = delta.embedding
    return [vectors[index] for index in range(len(prompts))]


def input_prompts(body: PoolingInputs, request: Request) -> list[Prompt]:
    """The inputs as text or token ids, or each conversation as its chat template renders it."""
    engine = request.app.state.engine
    if (body.input is None) == (body.messages is None):
        raise invalid_request("Give exactly one of 'input' and 'messages'.", "input")
    if body.input is not None:
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if getattr(body, name):  # nothing renders `input` with the template
                raise invalid_request(f"{name} applies to messages, not input.", name)
        special = body.add_special_tokens is not False
        return completion_prompts(body.input, engine, special, "input")
    if body.continue_final_message and body.add_generation_prompt:
        raise invalid_request(
            "continue_final_message and add_generation_prompt cannot both be true.",
            "continue_final_message",
        )
    options = TemplateOptions(
        body.add_generation_prompt,
        body.continue_final_message,
        template_kwargs(request, body.chat_template_kwargs),
        bool(body.add_special_tokens),
    )
    messages = body.messages or []
    conversations = messages if messages and isinstance(messages[0], list) else [messages]
    if not all(conversations):
        raise invalid_request("A conversation must hold at least one message.", "messages")
    if len(conversations) > engine.max_waiting_requests:
        raise invalid_request(
            f"At most {engine.max_waiting_requests} conversations fit in one request.", "messages"
        )
    return [chat_prompt(conversation, engine, None, options) for conversation in conversations]


def _shaped(vector: tuple[float, ...], body: EmbeddingRequest) -> list[float]:
    """The first `dimensions` values (all by default), L2-normalised unless asked not to be."""
    if body.dimensions is not None and body.dimensions > len(vector):
        raise invalid_request(
            f"dimensions is {body.dimensions}; this model's embeddings have {len(vector)}.",
            "dimensions",
        )
    values = list(vector[: body.dimensions])
    return normalized(values) if body.normalizes else values


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _encoded(values: list[float], body: EmbeddingRequest) -> list[float] | str:
    """As floats, or as base64 of the values' bytes in `embed_dtype` (rounded to nearest even)
    and `endianness` (OpenAI's: float32, the machine's order, little-endian on x86 and ARM)."""
    if body.encoding_format == "float":
        return values
    array = torch.tensor(values, dtype=torch.float32).to(DTYPES[body.embed_dtype])
    raw = array.view(torch.uint8).reshape(len(values), array.element_size())
    if (body.endianness == "big") == (sys.byteorder == "little"):
        raw = raw.flip(1)  # each value's bytes reversed
    return base64.b64encode(bytes(raw.flatten().tolist())).decode()
