"""Output-constraint request fields reach the engine as one `StructuredOutputs` (OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*`), and malformed shapes are 400s
naming the parameter before anything is queued. Compile errors are the engine's (tested there)."""

from __future__ import annotations

import json

import pytest

from pagedserve.configs import StructuredOutputs

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FORMAT = {"type": "triggered_tags", "triggers": ["<f="], "tags": []}
STRUCTURES = [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}]
LEGACY_TAG = {"structures": STRUCTURES, "triggers": ["<f="]}
FORMAT_TAG = {"type": "structural_tag", "format": FORMAT}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
}

ACCEPTED = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs("json_object")),
    ({"response_format": JSON_SCHEMA_FORMAT}, StructuredOutputs("json", json.dumps(SCHEMA))),
    ({"guided_regex": "[ab]+"}, StructuredOutputs("regex", "[ab]+")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputs("choice", ("x", "y"))),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputs("grammar", 'root ::= "a"')),
    ({"guided_json": '{"type": "string"}'}, StructuredOutputs("json", '{"type": "string"}')),
    ({"structured_outputs": {"regex": "a"}}, StructuredOutputs("regex", "a")),
    ({"structured_outputs": {"choice": ["a"]}}, StructuredOutputs("choice", ("a",))),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs("json_object")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs("json", json.dumps(SCHEMA))),
    ({"response_format": None, "guided_json": None}, None),
    (
        {"response_format": {"type": "structural_tag", "format": FORMAT}},
        StructuredOutputs("structural_tag", json.dumps(FORMAT_TAG)),
    ),
    (
        {"response_format": {"type": "structural_tag", **LEGACY_TAG}},
        StructuredOutputs("structural_tag", json.dumps(LEGACY_TAG)),
    ),
    (
        {"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}},
        StructuredOutputs("structural_tag", json.dumps(LEGACY_TAG)),
    ),
    (
        {"structured_outputs": {"structural_tag": FORMAT_TAG}},
        StructuredOutputs("structural_tag", json.dumps(FORMAT_TAG)),
    ),
]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("fields", "expected"), ACCEPTED)
def test_constraint_fields_reach_the_engine_as_one_constraint(
    client, engine, route, fields, expected
):
    body = {"messages": USER} if route.endswith("chat/completions") else {"prompt": "hi"}
    response = client.post(route, json={**body, "max_tokens": 4, **fields})
    assert response.status_code == 200, response.text
    [(_, _, params)] = engine.requests
    assert params.structured_outputs == expected


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),  # past the interpreter's limit
    ({"structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "structured_outputs.json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, None),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    # a field of another type would be read by nothing: refused, not ignored
    ({"response_format": {"type": "json_object", "format": FORMAT}}, "response_format"),
    ({"response_format": {**JSON_SCHEMA_FORMAT, "triggers": ["<f="]}}, "response_format"),
    (
        {"response_format": {**JSON_SCHEMA_FORMAT, "type": "structural_tag", "format": FORMAT}},
        "response_format",
    ),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES}}, "response_format"),
    (
        {"response_format": {"type": "structural_tag", "structures": [{}], "triggers": ["<"]}},
        "response_format",
    ),
    ({"structured_outputs": {"structural_tag": "{no"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs.structural_tag"),
    (
        {"structured_outputs": {"structural_tag": {**LEGACY_TAG, "triggers": [""]}}},
        "structured_outputs.structural_tag",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_malformed_constraint_is_a_400_naming_the_parameter(client, engine, fields, param):
    response = client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert engine.requests == []
