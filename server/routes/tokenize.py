"""POST /tokenize and /detokenize (vLLM's shapes): see what the model sees, count tokens."""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedserve.server.errors import invalid_request
from pagedserve.server.prompts import (
    TemplateOptions,
    chat_prompt,
    check_model,
    check_token_ids,
    encode_text,
    template_kwargs,
)
from pagedserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedserve.server.request_fields import check_request_fields

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    engine = request.app.state.engine
    check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("Give exactly one of 'prompt' and 'messages'.", "prompt")
    if body.messages is not None:
        options = TemplateOptions(
            body.add_generation_prompt,
            body.continue_final_message,
            template_kwargs(request, body.chat_template_kwargs),
            bool(body.add_special_tokens),
        )
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        token_ids = chat_prompt(body.messages, engine, tools or None, options).token_ids
    else:
        _check_no_chat_controls(body)
        add_special_tokens = body.add_special_tokens is not False
        token_ids = encode_text(engine, body.prompt, "prompt", add_special_tokens)
    return TokenizeResponse(
        tokens=token_ids,
        count=len(token_ids),
        max_model_len=engine.max_model_len,
        token_strs=engine.tokenizer.convert_ids_to_tokens(token_ids)
        if body.return_token_strs
        else None,
    )


def _check_no_chat_controls(body: TokenizeRequest) -> None:
    """The chat controls shape a rendered chat: with a plain prompt they would do nothing."""
    asked = {
        "tools": bool(body.tools),
        "add_generation_prompt": not body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "chat_template_kwargs": bool(body.chat_template_kwargs),
    }
    for name, asks in asked.items():
        if asks:
            raise invalid_request(f"{name} applies to messages, not to a prompt.", name)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = request.app.state.engine
    check_model(body.model, engine)
    check_request_fields(body, request.state.request_id)
    check_token_ids(body.tokens, engine.vocab_size, "tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))
