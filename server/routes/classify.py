"""POST /classify (vLLM's): each input's class probabilities from a sequence classifier
(engine/classifier.py): the head over the final hidden state of the input's last token that is
not padding, softmax over the labels (a sigmoid for one label) unless `use_activation` is false.

The hidden states come from the embedding path (server/routes/embeddings.py `embed_prompts`):
one one-token engine request per input, batched with everything else.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from pagedserve.engine.classifier import ClassifierHead, probabilities
from pagedserve.server.errors import invalid_request
from pagedserve.server.prompts import Prompt, check_model
from pagedserve.server.request_fields import check_request_fields
from pagedserve.server.routes.embeddings import (
    EmbeddingOptions,
    PoolingInputs,
    embed_prompts,
    input_prompts,
    truncated_inputs,
)

router = APIRouter()


class ClassificationRequest(PoolingInputs):
    """`input`, or vLLM's chat-style `messages` (ClassificationChatRequest), as embeddings take
    them."""

    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    use_activation: bool | None = None  # vLLM 0.32's name; `activation` before
    activation: bool | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, max_length=1024)
    user: str | None = None


def classifier_of(engine: Any) -> ClassifierHead:
    head = engine.classifier
    if head is None:
        raise invalid_request(
            "/classify needs a sequence classifier (a *ForSequenceClassification checkpoint); "
            "this model is not one (its embeddings: /v1/embeddings).",
            "model",
        )
    return head


def activation_wanted(use_activation: bool | None, activation: bool | None) -> bool:
    """vLLM's `use_activation` (`activation` before 0.32): softmax or sigmoid, on by default."""
    chosen = use_activation if use_activation is not None else activation
    return chosen is not False


def pooled_prompts(prompts: list[Prompt], head: ClassifierHead) -> list[Prompt]:
    """Each prompt up to its last token that is not padding, where the head reads it."""
    return [Prompt(head.pooled(prompt.token_ids), prompt.text) for prompt in prompts]


@router.post("/classify")
async def create_classification(body: ClassificationRequest, request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    head = classifier_of(engine)
    lora = check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    inputs = input_prompts(body, request)
    prompts = truncated_inputs(inputs, body.truncate_prompt_tokens, body.truncation_side, engine)
    options = EmbeddingOptions(lora, body.priority, body.cache_salt)
    states = await embed_prompts(request, pooled_prompts(prompts, head), options)
    activated = activation_wanted(body.use_activation, body.activation)
    data = []
    for index, logits in enumerate(head.logits(states)):
        data.append(
            {
                "index": index,
                "label": head.best_label(logits),
                "probs": probabilities(logits) if activated else logits,
                "num_classes": head.num_labels,
            }
        )
    num_tokens = sum(len(prompt.token_ids) for prompt in prompts)
    return {
        "id": f"classify-{request.state.request_id}",
        "object": "list",
        "created": request.state.created,
        "model": lora or engine.model_name,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
    }
