"""GET /v1/models and /v1/models/{model}: the one served model."""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedserve.server.errors import model_not_found
from pagedserve.server.protocol import ModelCard, ModelList

router = APIRouter()


def _card(request: Request) -> ModelCard:
    engine = request.app.state.engine
    return ModelCard(
        id=engine.model_name,
        created=request.app.state.started_at,
        max_model_len=engine.max_model_len,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(request)])


@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    card = _card(request)
    if model != card.id:
        raise model_not_found(model)
    return card
