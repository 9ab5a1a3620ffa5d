"""Request fields that constrain the output: OpenAI's `response_format`, vLLM's
`structured_outputs` object and its older `guided_*` fields, turned into one `StructuredOutputs`.

Only the shape is checked here (one constraint per request, a known `response_format.type`, JSON
that parses); whether a schema, regex or grammar compiles is the engine's 400 to raise.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.configs import StructuredOutputs
from pagedserve.server.errors import invalid_request
from pagedserve.server.json_input import load_json
from pagedserve.server.protocol import ResponseFormat, SamplingFields

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def to_structured_outputs(body: SamplingFields) -> StructuredOutputs | None:
    """The request's one constraint (None: free text). Raises a 400 APIError for a bad shape;
    SamplingParamsError (also a 400) for an empty or oversized one."""
    found = [
        c for c in (_from_response_format(body.response_format), *_from_vllm_fields(body)) if c
    ]
    if len(found) > 1:
        params = ", ".join(constraint.param for constraint in found)
        raise invalid_request(
            f"at most one output constraint per request, got {len(found)} ({params})",
            found[1].param,
        )
    return found[0] if found else None


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutputs | None:
    if response_format is None:
        return None
    _check_fields_of_its_type(response_format)
    if response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputs("json_object", "", "response_format")
    if response_format.type == "structural_tag":
        return _structural_tag_format(response_format)
    if response_format.type != "json_schema":
        raise invalid_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; "
            f"got {response_format.type!r}",
            "response_format",
        )
    if response_format.json_schema is None:
        raise invalid_request(
            "response_format of type json_schema needs a json_schema object", "response_format"
        )
    schema = response_format.json_schema.schema_
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return StructuredOutputs("json_object", "", "response_format")
    return StructuredOutputs("json", json.dumps(schema), "response_format")


def _from_vllm_fields(body: SamplingFields) -> list[StructuredOutputs | None]:
    found: list[StructuredOutputs | None] = [
        _json("guided_json", body.guided_json),
        _text("regex", "guided_regex", body.guided_regex),
        _choice("guided_choice", body.guided_choice),
        _text("grammar", "guided_grammar", body.guided_grammar),
    ]
    nested = body.structured_outputs
    if nested is not None:
        found += [
            _json("structured_outputs.json", nested.json_),
            _text("regex", "structured_outputs.regex", nested.regex),
            _choice("structured_outputs.choice", nested.choice),
            _text("grammar", "structured_outputs.grammar", nested.grammar),
            structural_tag("structured_outputs.structural_tag", nested.structural_tag),
        ]
        if nested.json_object:
            found.append(StructuredOutputs("json_object", "", "structured_outputs.json_object"))
        if all(constraint is None for constraint in found[4:]):
            # An object that constrains nothing is a mistake, not a request for free text.
            raise invalid_request(
                "structured_outputs needs one constraint: json, regex, choice, grammar, "
                "json_object or structural_tag",
                "structured_outputs",
            )
    return found


def _json(param: str, value: str | dict[str, Any] | None) -> StructuredOutputs | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            parsed = load_json(value)
        except ValueError as error:
            raise invalid_request(f"{param} is not valid JSON: {error}", param) from None
        if not isinstance(parsed, (dict, bool)):
            raise invalid_request(f"{param} must be a JSON schema object", param)
        return StructuredOutputs("json", value, param)
    return StructuredOutputs("json", json.dumps(value), param)


def _text(kind: str, param: str, value: str | None) -> StructuredOutputs | None:
    return None if value is None else StructuredOutputs(kind, value, param)  # type: ignore[arg-type]


def _choice(param: str, value: list[str] | None) -> StructuredOutputs | None:
    return None if value is None else StructuredOutputs("choice", tuple(value), param)


# The response_format fields each type reads; any other type leaves them unread.
_TYPE_OF_FIELD = {
    "json_schema": "json_schema",
    "format": "structural_tag",
    "structures": "structural_tag",
    "triggers": "structural_tag",
}


def _check_fields_of_its_type(response_format: ResponseFormat) -> None:
    """A 400 for a field of another type of response_format (a structural tag's `format` beside
    type json_schema, say): nothing would read it, so it would constrain nothing."""
    for name, owner in _TYPE_OF_FIELD.items():
        if getattr(response_format, name) is not None and response_format.type != owner:
            raise invalid_request(
                f"response_format.{name} applies to type {owner}, not {response_format.type}",
                "response_format",
            )


def _structural_tag_format(response_format: ResponseFormat) -> StructuredOutputs:
    """vLLM's response_format of type structural_tag: xgrammar's `format` tree, or the original
    `structures` (begin, schema, end) with their `triggers`."""
    if response_format.format is None and response_format.structures is not None:
        tag = {"structures": response_format.structures, "triggers": response_format.triggers}
    else:
        tag = {"type": "structural_tag", "format": response_format.format}
    constraint = structural_tag("response_format", tag)
    assert constraint is not None  # given a value
    return constraint


def structural_tag(param: str, value: str | dict[str, Any] | None) -> StructuredOutputs | None:
    """A structural tag given as its JSON (text or object): either shape, checked enough that the
    compiler gets the fields it reads (engine/structured_outputs/structural_tag.py)."""
    if value is None:
        return None
    tag = value
    if isinstance(value, str):
        try:
            tag = load_json(value)
        except ValueError as error:
            raise invalid_request(f"{param} is not valid JSON: {error}", param) from None
    if not isinstance(tag, dict):
        raise invalid_request(f"{param} must be a JSON object", param)
    if "structures" in tag:
        _check_structures(param, tag)
    elif not isinstance(tag.get("format"), dict):
        raise invalid_request(f"{param} needs a format object, or structures and triggers", param)
    return StructuredOutputs("structural_tag", json.dumps(tag), param)


def _check_structures(param: str, tag: dict[str, Any]) -> None:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    good_structures = (
        isinstance(structures, list)
        and bool(structures)
        and all(
            isinstance(item, dict)
            and isinstance(item.get("begin"), str)
            and isinstance(item.get("end"), str)
            and isinstance(item.get("schema"), (dict, bool))
            for item in structures
        )
    )
    if not good_structures:
        raise invalid_request(
            f"{param}: structures must be a non-empty list of objects with begin and end "
            "(strings) and schema (a JSON schema)",
            param,
        )
    if not (
        isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)
    ):
        raise invalid_request(f"{param}: triggers must be a non-empty list of strings", param)
