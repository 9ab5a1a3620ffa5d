"""POST /score and /rerank (vLLM's, also under /v1, and /v2/rerank as Cohere's clients call it):
how close texts are, as vLLM scores them: with a generative or embedding model, by the cosine of
their embeddings (server/routes/embeddings.py); with a sequence classifier of one label (a
cross-encoder reranker, engine/classifier.py), by the sigmoid of its head over each pair, the
two texts encoded together as the tokenizer encodes a pair.

Every text (or pair) of a request is computed once, in one engine batch. `/score` pairs `text_1` (or
`queries`, `data_1`) with `text_2` (`documents`, `items`, `data_2`): one against each of a list,
or two lists of the same length element by element. `/rerank` scores `documents` against
`query` and returns them best first (`top_n` of them; 0: all).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from fastapi import APIRouter, Request
from pydantic import Field

from pagedserve.engine.classifier import probabilities
from pagedserve.server.errors import invalid_request
from pagedserve.server.prompts import (
    Prompt,
    check_model,
    check_unicode,
    completion_prompts,
    truncated,
)
from pagedserve.server.protocol import _Options
from pagedserve.server.request_fields import check_request_fields
from pagedserve.server.routes.classify import activation_wanted, pooled_prompts
from pagedserve.server.routes.embeddings import EmbeddingOptions, embed_prompts, truncation

router = APIRouter()

# vLLM's names for the two sides of /score
FIRST_SIDE = ("text_1", "queries", "data_1")
SECOND_SIDE = ("text_2", "documents", "items", "data_2")


class _ScoringRequest(_Options):
    model: str | None = None
    use_activation: bool | None = None  # a cross-encoder's sigmoid (vLLM's; `activation` before)
    activation: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    padding: Literal["do_not_pad"] | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, max_length=1024)
    user: str | None = None


class TextObject(_Options):
    """A document as Jina's and Cohere's clients send it."""

    text: str


Text = str | TextObject


class ScoreRequest(_ScoringRequest):
    text_1: Text | list[Text] | None = None
    text_2: Text | list[Text] | None = None
    queries: Text | list[Text] | None = None
    documents: Text | list[Text] | None = None
    items: Text | list[Text] | None = None
    data_1: Text | list[Text] | None = None
    data_2: Text | list[Text] | None = None


class RerankRequest(_ScoringRequest):
    query: Text
    documents: list[Text] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True  # Jina's and Cohere's (vLLM always returns them)


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    first, second = _side(body, FIRST_SIDE), _side(body, SECOND_SIDE)
    if len(first[1]) > 1 and len(first[1]) != len(second[1]):
        raise invalid_request(
            f"{len(first[1])} first texts against {len(second[1])} second texts: give one first "
            "text, or as many as second texts.",
            first[0],
        )
    scores, num_tokens, model = await _scores(request, body, first, second)
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
    documents = [_text(document) for document in body.documents]
    query = ("query", [_text(body.query)])
    scores, num_tokens, model = await _scores(request, body, query, ("documents", documents))
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    results = [
        {"index": index, "relevance_score": scores[index]}
        | ({"document": {"text": documents[index]}} if body.return_documents else {})
        for index in order[: body.top_n or None]
    ]
    return {
        "id": f"rerank-{request.state.request_id}",
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }


def _text(value: Text) -> str:
    return value if isinstance(value, str) else value.text


def _side(body: ScoreRequest, names: tuple[str, ...]) -> tuple[str, list[str]]:
    """The field that gives this side (exactly one of `names`) and its texts."""
    given = [name for name in names if getattr(body, name) is not None]
    if len(given) != 1:
        raise invalid_request(f"Give exactly one of {', '.join(names)}.", names[0])
    value = getattr(body, given[0])
    texts = [_text(item) for item in (value if isinstance(value, list) else [value])]
    if not texts:
        raise invalid_request(f"{given[0]} must not be empty.", given[0])
    return given[0], texts


async def _scores(
    request: Request,
    body: _ScoringRequest,
    first: tuple[str, list[str]],
    second: tuple[str, list[str]],
) -> tuple[list[float], int, str]:
    """Each pair's score (the first text against each second one, or pairwise), the prompt
    tokens of every input position (as vLLM counts them), and the model name to answer with."""
    engine = request.app.state.engine
    lora = check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):  # vLLM's and Cohere's
        if (body.model_extra or {}).get(name) is not None:
            raise invalid_request(f"{name} is not supported; use truncate_prompt_tokens.", name)
    left, right = first[1], second[1]
    pairs = list(zip(left * len(right) if len(left) == 1 else left, right, strict=True))
    options = EmbeddingOptions(lora, body.priority, body.cache_salt)
    if engine.classifier is not None:
        scores, num_tokens = await _cross_encoded(request, body, options, pairs, second[0])
    else:
        scores, num_tokens = await _cosines(request, body, options, first, second, pairs)
    return scores, num_tokens, lora or engine.model_name


async def _cross_encoded(
    request: Request,
    body: _ScoringRequest,
    options: EmbeddingOptions,
    pairs: list[tuple[str, str]],
    name: str,
) -> tuple[list[float], int]:
    """A cross-encoder's scores: the sigmoid of its one-label head over each pair."""
    engine = request.app.state.engine
    head = engine.classifier
    if head.num_labels != 1:
        raise invalid_request(
            f"This classifier has {head.num_labels} labels; a score needs one (a cross-encoder). "
            "Its probabilities: /classify.",
            "model",
        )
    _check_fits(engine, len(pairs), "pairs fit in one request", name)
    side, longest = truncation(engine, body.truncation_side)
    encoded = {}
    for position, pair in enumerate(pairs):
        if pair in encoded:
            continue
        for text in pair:  # a lone surrogate is a 400 here, as anywhere else
            check_unicode(text, name)
        token_ids = _pair_tokens(engine, pair, body.truncate_prompt_tokens, side, longest)
        if not token_ids:
            raise invalid_request(f"{name}[{position}] and its pair are empty.", name)
        prompt = Prompt(token_ids, "")
        if len(prompt.token_ids) > longest:
            raise invalid_request(
                f"{name}[{position}] and its pair have {len(prompt.token_ids)} tokens; this model "
                f"reads at most {longest} (truncate_prompt_tokens -1 cuts to it).",
                name,
            )
        encoded[pair] = prompt
    distinct = list(encoded)
    prompts = pooled_prompts([encoded[pair] for pair in distinct], head)
    states = await embed_prompts(request, prompts, options)
    activated = activation_wanted(body.use_activation, body.activation)
    score = {
        pair: probabilities(logits)[0] if activated else logits[0]
        for pair, logits in zip(distinct, head.logits(states), strict=True)
    }
    return [score[pair] for pair in pairs], sum(len(encoded[pair].token_ids) for pair in pairs)


def _pair_tokens(
    engine: Any, pair: tuple[str, str], limit: int | None, side: str, longest: int
) -> list[int]:
    """The two texts encoded as the tokenizer encodes a pair; with truncate_prompt_tokens, cut
    as the tokenizer cuts a pair (the longer text first, as vLLM asks it to), so a long query
    cannot push its document out."""
    if limit is None:
        return list(engine.tokenizer(*pair)["input_ids"])
    tokenizer = engine.tokenizer
    kept_side = tokenizer.truncation_side
    tokenizer.truncation_side = side
    try:
        max_length = longest if limit == -1 else min(limit, longest)
        encoded = tokenizer(*pair, truncation=True, max_length=max_length)
    finally:
        tokenizer.truncation_side = kept_side
    return list(encoded["input_ids"])


async def _cosines(
    request: Request,
    body: _ScoringRequest,
    options: EmbeddingOptions,
    first: tuple[str, list[str]],
    second: tuple[str, list[str]],
    pairs: list[tuple[str, str]],
) -> tuple[list[float], int]:
    """Each pair's cosine of the two texts' embeddings; every distinct text embedded once."""
    engine = request.app.state.engine
    tokens = {
        **_tokenized(body, engine, *first),
        **_tokenized(body, engine, *second),
    }
    texts = list(tokens)  # each distinct text embedded once
    prompts = [tokens[text] for text in texts]
    states = await embed_prompts(request, prompts, options)
    unit = torch.nn.functional.normalize(torch.tensor(states), dim=1)
    index = {text: position for position, text in enumerate(texts)}
    rows = torch.tensor([index[left] for left, _ in pairs])
    columns = torch.tensor([index[right] for _, right in pairs])
    scores = (unit[rows] * unit[columns]).sum(dim=1).tolist()
    num_tokens = sum(len(tokens[text].token_ids) for text in (*first[1], *second[1]))
    return scores, num_tokens


def _tokenized(
    body: _ScoringRequest, engine: Any, name: str, texts: list[str]
) -> dict[str, Prompt]:
    """Each text of one side as its (truncated) prompt; a side longer than the server takes in
    one request, or a text with no room, is a 400 naming the side's field."""
    _check_fits(engine, len(texts), f"texts fit in {name}", name)
    side, longest = truncation(engine, body.truncation_side)
    distinct = list(dict.fromkeys(texts))
    prompts = {
        text: truncated(prompt, body.truncate_prompt_tokens, engine, side, longest)
        for text, prompt in zip(
            distinct, completion_prompts(distinct, engine, True, name), strict=True
        )
    }
    for position, text in enumerate(texts):
        if len(prompts[text].token_ids) > longest:
            raise invalid_request(
                f"{name}[{position}] has {len(prompts[text].token_ids)} tokens; this model "
                f"embeds at most {longest} (truncate_prompt_tokens -1 cuts to it).",
                name,
            )
    return prompts


def _check_fits(engine: Any, count: int, what: str, name: str) -> None:
    """Each text or pair is one engine request: no more than the server runs at once."""
    if count > engine.max_waiting_requests:
        raise invalid_request(
            f"At most {engine.max_waiting_requests} {what} (the server's max_waiting_requests); "
            f"got {count}.",
            name,
        )
