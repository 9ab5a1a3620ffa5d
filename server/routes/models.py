"""GET /v1/models and /v1/models/{model}: the served model under each of its names
(--served-model-name, vLLM's), then each LoRA adapter it serves (vLLM's cards: an adapter's
`parent` is the model, its `root` the adapter's folder)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedserve.server.errors import model_not_found
from pagedserve.server.protocol import ModelCard, ModelList

router = APIRouter()


def _cards(request: Request) -> list[ModelCard]:
    engine, state = request.app.state.engine, request.app.state
    model = ModelCard(
        id=engine.model_name, created=state.started_at, max_model_len=engine.max_model_len
    )
    aliases = [model.model_copy(update={"id": name}) for name in engine.served_model_names[1:]]
    adapters = engine.lora_adapters
    return [model, *aliases] + [
        model.model_copy(update={"id": name, "root": path, "parent": model.id})
        for name, path in adapters.items()
    ]


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=_cards(request))


@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    card = next((card for card in _cards(request) if card.id == model), None)
    if card is None:
        raise model_not_found(model)
    return card
