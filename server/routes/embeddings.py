"""POST /v1/embeddings (OpenAI's and vLLM's shape): each input's embedding, the final hidden state
of its last token (engine/embeddings.py), L2-normalised unless `normalize` is false (vLLM's), and
cut to its first `dimensions` (then normalised again) for Matryoshka-trained models.

Each input is an engine request of one token batched with everything else: the same paged
cache, prefix cache and scheduler as generation. Inputs are strings or token ids; an input may
hold at most the context length less one token (the one token the engine samples and drops).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from pagedserve.configs import SamplingParams
from pagedserve.engine.embeddings import normalized
from pagedserve.engine.errors import RequestFailedError
from pagedserve.server.errors import invalid_request
from pagedserve.server.generation import EngineInput, start_generation
from pagedserve.server.prompts import check_model, completion_prompts, truncated
from pagedserve.server.protocol import _Options
from pagedserve.server.recorder import RequestRecorder
from pagedserve.server.request_fields import check_request_fields

router = APIRouter()


class EmbeddingRequest(_Options):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's
    normalize: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = Field(None, max_length=1024)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    lora = check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    prompts = [
        truncated(prompt, body.truncate_prompt_tokens, engine)
        for prompt in completion_prompts(body.input, engine, body.add_special_tokens, "input")
    ]
    for index, prompt in enumerate(prompts):
        if len(prompt.token_ids) >= engine.max_model_len:
            raise invalid_request(
                f"Input {index} has {len(prompt.token_ids)} tokens; this model embeds at most "
                f"{engine.max_model_len - 1} (its context length less one).",
                "input",
            )
    params = SamplingParams(
        max_tokens=1, temperature=0.0, embed=True, lora=lora, cache_salt=body.cache_salt
    )
    inputs = [EngineInput(prompt.token_ids, params, body.priority) for prompt in prompts]
    recorder = RequestRecorder(
        request.app.state.metrics,
        request.state.request_id,
        request.state.arrival_time,
        [len(prompt.token_ids) for prompt in prompts],
        1,
    )
    stream = await start_generation(request, inputs, recorder)
    vectors: dict[int, tuple[float, ...]] = {}
    async for prompt_index, delta in stream:
        if delta.finished:
            if delta.embedding is None:  # cannot happen: every embed request finishes with one
                raise RequestFailedError("The engine returned no embedding.")
            vectors[prompt_index] = delta.embedding
    num_prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
    return {
        "id": f"embd-{recorder.request_id}",
        "object": "list",
        "created": request.state.created,
        "model": lora or engine.model_name,
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(_shaped(vectors[index], body), body.encoding_format),
            }
            for index in range(len(prompts))
        ],
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


def _shaped(vector: tuple[float, ...], body: EmbeddingRequest) -> list[float]:
    """The first `dimensions` values (all by default), L2-normalised unless `normalize` is false."""
    if body.dimensions is not None and body.dimensions > len(vector):
        raise invalid_request(
            f"dimensions is {body.dimensions}; this model's embeddings have {len(vector)}.",
            "dimensions",
        )
    values = list(vector[: body.dimensions])
    return normalized(values) if body.normalize else values


def _encoded(values: list[float], encoding_format: str) -> list[float] | str:
    """As floats, or OpenAI's base64: the little-endian float32 bytes."""
    if encoding_format == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
