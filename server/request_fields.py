"""Request fields outside the ones the server reads: refused where they would change the answer,
logged where they would not.

A request model keeps the keys it does not declare (`extra="allow"`, server/protocol.py). Among
them, parameters that vLLM (or OpenAI) implements and pagedserve does not are a 400 naming the
field as soon as they ask for something (special tokens spaced out, a client's template, logits
processors...): answering 200 with ordinary sampling would let the client believe it got what it
asked for. Sent with their "do nothing" value (`spaces_between_special_tokens: true`, `[]`, null)
they are accepted, so clients that always send them work.
Any other unknown key is ignored, as vLLM does, and logged once per request, so a misspelt
parameter shows up in the server log rather than nowhere.

The same holds inside the nested objects (`response_format`, its `json_schema`, `stream_options`),
except `structured_outputs`, where an unknown key is a 400 (vLLM ignores it): a misspelt
constraint there would otherwise leave the output unconstrained without a word.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from pagedserve.server.errors import invalid_request

logger = logging.getLogger(__name__)

# Field -> the values that ask for nothing beyond what the server does anyway (None is always one).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "spaces_between_special_tokens": (True,),
    "logits_processors": ([],),
    "prompt_embeds": (),
    "guided_whitespace_pattern": (),
    "chat_template": (),  # a template from the client: the model's own is the only one served
    "documents": ([],),
    "functions": ([],),  # OpenAI's deprecated function calling: `tools` replaces it
    "function_call": (),
}
# vLLM's structured_outputs options beyond the constraint itself. Our JSON grammars are compact and,
# under a schema, closed to undeclared properties (engine/structured_outputs/compiler.py): output
# that satisfies either value of the two flags, so neither value asks for something we do not do.
STRUCTURED_OUTPUTS_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "disable_any_whitespace": (True, False),
    "disable_additional_properties": (True, False),
    "whitespace_pattern": (),
}
_HINTS = {
    "functions": " Send them as `tools` (type function).",
    "function_call": " Use `tool_choice`.",
}


def check_request_fields(body: BaseModel, request_id: str) -> None:
    """Raises 400 for an unsupported parameter that asks for something; logs the other unknown
    keys of `body` and of its nested objects (request models with extra="allow")."""
    ignored = _judge(body, "", UNSUPPORTED)
    for path, nested in _nested_objects(body):
        if path == "structured_outputs.":
            strict = _judge(nested, path, STRUCTURED_OUTPUTS_UNSUPPORTED)
            if strict:
                raise invalid_request(
                    f"{strict[0]} is not a structured_outputs field (json, regex, choice, "
                    "grammar or json_object).",
                    strict[0],
                )
        else:
            ignored += _judge(nested, path, {})
    if ignored:
        logger.warning(
            "request %s: ignored fields the API does not define: %s",
            request_id,
            ", ".join(sorted(ignored)),
        )


def _judge(model: BaseModel, path: str, unsupported: dict[str, tuple[Any, ...]]) -> list[str]:
    """Raises 400 for a field of `unsupported` that asks for something; returns the other unknown
    keys of `model`, prefixed with `path`."""
    unknown = []
    for name, value in (model.model_extra or {}).items():
        if name not in unsupported:
            unknown.append(path + name)
        elif value is not None and not _asks_nothing(value, unsupported[name]):
            raise invalid_request(
                f"{path}{name} is not supported by this server.{_HINTS.get(name, '')}",
                path + name,
            )
    return unknown


def _nested_objects(body: BaseModel) -> list[tuple[str, BaseModel]]:
    """The request's nested objects that keep their unknown keys, with their paths ("a.b.")."""
    found = []
    for name in ("stream_options", "response_format", "structured_outputs"):
        nested = getattr(body, name, None)
        if isinstance(nested, BaseModel):
            found.append((f"{name}.", nested))
            schema = getattr(nested, "json_schema", None)
            if isinstance(schema, BaseModel):
                found.append((f"{name}.json_schema.", schema))
    return found


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type() as well as ==, so that `1` is not taken for `True` (nor `0` for `False`).
    return any(type(value) is type(choice) and value == choice for choice in neutral)
