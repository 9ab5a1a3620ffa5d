"""POST /score and /rerank (vLLM's, also under /v1, and /v2/rerank as Cohere's clients call it):
how close texts are, by the cosine of their embeddings (server/routes/embeddings.py), as vLLM
scores with an embedding model. A cross-encoder's score (a classifier head read over the pair)
is not computed: the served model is a decoder whose last-token state is the embedding.

Every text of a request is embedded once, in one engine batch. `/score` pairs `text_1` (or
`queries`, `data_1`) with `text_2` (`documents`, `items`, `data_2`): one against each of a list,
or two lists of the same length element by element. `/rerank` scores `documents` against
`query` and returns them best first (`top_n` of them; 0: all).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from pagedserve.engine.embeddings import normalized
from pagedserve.server.errors import invalid_request
from pagedserve.server.prompts import Prompt, check_model, completion_prompts, truncated
from pagedserve.server.protocol import _Options
from pagedserve.server.request_fields import check_request_fields
from pagedserve.server.routes.embeddings import EmbeddingOptions, embed_prompts

router = APIRouter()

# vLLM's names for the two sides of /score
FIRST_SIDE = ("text_1", "queries", "data_1")
SECOND_SIDE = ("text_2", "documents", "items", "data_2")


class _ScoringRequest(_Options):
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0
    user: str | None = None


class ScoreRequest(_ScoringRequest):
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None


class RerankRequest(_ScoringRequest):
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(0, ge=0)
    return_documents: bool = True


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    first, second = _side(body, FIRST_SIDE), _side(body, SECOND_SIDE)
    if len(first) > 1 and len(first) != len(second):
        raise invalid_request(
            f"{len(first)} first texts against {len(second)} second texts: give one first text, "
            "or as many as second texts.",
            FIRST_SIDE[0],
        )
    scores, num_tokens, model = await _cosines(request, body, first, second)
    return {
        "id": f"score-{request.state.request_id}",
        "object": "list",
        "created": request.state.created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    scores, num_tokens, model = await _cosines(request, body, [body.query], body.documents)
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    results = [
        {"index": index, "relevance_score": scores[index]}
        | ({"document": {"text": body.documents[index]}} if body.return_documents else {})
        for index in order[: body.top_n or None]
    ]
    return {
        "id": f"rerank-{request.state.request_id}",
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }


def _side(body: ScoreRequest, names: tuple[str, ...]) -> list[str]:
    given = [name for name in names if getattr(body, name) is not None]
    if len(given) != 1:
        raise invalid_request(f"Give exactly one of {', '.join(names)}.", names[0])
    value = getattr(body, given[0])
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise invalid_request(f"{given[0]} must not be empty.", given[0])
    return texts


async def _cosines(
    request: Request, body: _ScoringRequest, first: list[str], second: list[str]
) -> tuple[list[float], int, str]:
    """Each pair's cosine (the first text against each second one, or pairwise), the prompt
    tokens embedded, and the model name to answer with."""
    engine = request.app.state.engine
    lora = check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    texts = list(dict.fromkeys([*first, *second]))  # each distinct text embedded once
    side = getattr(engine.tokenizer, "truncation_side", "right")  # as /v1/embeddings
    prompts: list[Prompt] = [
        truncated(prompt, body.truncate_prompt_tokens, engine, side, engine.max_model_len - 1)
        for prompt in completion_prompts(texts, engine, True, "input")
    ]
    states = await embed_prompts(request, prompts, EmbeddingOptions(lora, body.priority))
    unit = {text: normalized(state) for text, state in zip(texts, states, strict=True)}
    pairs = zip(first * len(second) if len(first) == 1 else first, second, strict=True)
    scores = [sum(a * b for a, b in zip(unit[x], unit[y], strict=True)) for x, y in pairs]
    return scores, sum(len(prompt.token_ids) for prompt in prompts), lora or engine.model_name
