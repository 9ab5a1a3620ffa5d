"""SageMaker's container contract, as vLLM serves it: `GET`/`POST /ping` is the health check,
`POST /invocations` a request of any kind, sent to the route whose request it is (by the fields
that only that request has), so one endpoint serves chat, completions, embeddings (a
classifier's /classify), scores and SGLang's /generate."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from pagedserve.server.errors import invalid_request
from pagedserve.server.generate_protocol import GenerateRequest
from pagedserve.server.json_input import load_json
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.routes import chat, classify, completions, embeddings, generate, scores
from pagedserve.server.routes.system import health

router = APIRouter()

# (a field only this request has, its model, its handler); the first whose field is present wins
ROUTES: tuple[tuple[str, type[BaseModel], Any], ...] = (
    ("messages", ChatCompletionRequest, chat.create_chat_completion),
    ("prompt", CompletionRequest, completions.create_completion),
    ("query", scores.RerankRequest, scores.create_rerank),
    ("text_1", scores.ScoreRequest, scores.create_score),
    ("queries", scores.ScoreRequest, scores.create_score),
    ("text", GenerateRequest, generate.generate),
    ("input_ids", GenerateRequest, generate.generate),
    ("input", embeddings.EmbeddingRequest, embeddings.create_embeddings),
)


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> Response:
    return await health(request)


@router.post("/invocations")
async def invocations(request: Request) -> Any:
    try:
        data = load_json((await request.body()).decode("utf-8"))
    except ValueError as error:
        raise invalid_request(f"The request body is not valid JSON: {error}.") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    for field, model, handler in ROUTES:
        if field in data:
            if model is embeddings.EmbeddingRequest and request.app.state.engine.classifier:
                model, handler = classify.ClassificationRequest, classify.create_classification
            try:
                body = model.model_validate(data)
            except ValidationError as error:  # named as the route would name it
                raise RequestValidationError(
                    [{**e, "loc": ("body", *e["loc"])} for e in error.errors()]
                ) from None
            return await handler(body, request)
    raise invalid_request(
        "The request is none the server knows: give messages (chat), prompt (completions), "
        "input (embeddings, or a classifier's /classify), query (rerank), text_1 or queries "
        "(score), or text or input_ids (SGLang's /generate).",
    )
