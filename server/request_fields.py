"""Request fields outside the ones the server reads: refused where they would change the answer,
logged where they would not.

A request model keeps the keys it does not declare (`extra="allow"`, server/protocol.py). Among
them, parameters that vLLM (or OpenAI) implements and pagedserve does not are a 400 naming the
field as soon as they ask for something (beam search, special tokens spaced out, a client's
template...): answering 200 with ordinary sampling would let the client believe it got what it
asked for. Sent with their "do nothing" value (`use_beam_search: false`, `length_penalty: 1`,
null) they are accepted, so clients that always send them work.
Any other unknown key is ignored, as vLLM does, and logged once per request, so a misspelt
parameter shows up in the server log rather than nowhere.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from pagedserve.server.errors import invalid_request

logger = logging.getLogger(__name__)

# Field -> the values that ask for nothing beyond what the server does anyway (None is always one).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,),
    "logits_processors": ([],),
    "prompt_embeds": (),
    "guided_whitespace_pattern": (),
    "chat_template": (),  # a template from the client: the model's own is the only one served
    "documents": ([],),
    "functions": ([],),  # OpenAI's deprecated function calling: `tools` replaces it
    "function_call": (),
    "echo": (False,),  # chat only: completions declares its own `echo`
}
_HINTS = {
    "functions": " Send them as `tools` (type function).",
    "function_call": " Use `tool_choice`.",
}


def check_request_fields(body: BaseModel, request_id: str) -> None:
    """Raises 400 for an unsupported parameter that asks for something; logs the other unknown
    keys of `body` (a request model with extra="allow")."""
    ignored = []
    for name, value in (body.model_extra or {}).items():
        if name not in UNSUPPORTED:
            ignored.append(name)
        elif value is not None and not _asks_nothing(value, UNSUPPORTED[name]):
            raise invalid_request(
                f"{name} is not supported by this server.{_HINTS.get(name, '')}", name
            )
    if ignored:
        logger.warning(
            "request %s: ignored fields the API does not define: %s",
            request_id,
            ", ".join(sorted(ignored)),
        )


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type() as well as ==, so that `1` is not taken for `True` (nor `0` for `False`).
    return any(type(value) is type(choice) and value == choice for choice in neutral)
