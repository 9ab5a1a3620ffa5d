"""Structural tags (engine/structured_outputs/structural_tag.py): a forced tag's content follows
its schema in generation; triggered tags leave text free and constrain what follows a trigger;
the schemas inside a tag meet the same limits and checks as a schema sent alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar

from pagedserve.configs import SamplingParams, StructuredOutputs
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured_outputs.structural_tag import tag_parts
from tests.engine.conftest import make_engine, run_to_completion

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
FORCED = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<tool>",
        "content": {"type": "json_schema", "json_schema": WEATHER},
        "end": "</tool>",
    },
}
LEGACY = {
    "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}],
    "triggers": ["<function="],
}
TRIGGERED = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "type": "tag",
                "begin": "<function=get_weather>",
                "content": {"type": "json_schema", "json_schema": WEATHER},
                "end": "</function>",
            }
        ],
    },
}


def _tag(tag: dict, param: str = "response_format") -> StructuredOutputs:
    return StructuredOutputs("structural_tag", json.dumps(tag), param)


@pytest.fixture(scope="module")
def engine(default_loaded):
    return make_engine(default_loaded, num_kv_blocks=128, block_size=16)


def test_a_forced_tag_s_content_follows_its_schema(engine):
    prompt = engine.tokenizer.encode("What is the weather in Paris?")
    params = SamplingParams(structured_outputs=_tag(FORCED), temperature=0.0, max_tokens=40)
    engine.add_request("w", prompt, params)
    run = run_to_completion(engine)
    match = re.fullmatch(r"<tool>(.*)</tool>", run.texts["w"], re.S)
    assert match is not None and run.finish_reasons["w"] == "stop"
    jsonschema.validate(json.loads(match.group(1)), WEATHER)


@pytest.mark.parametrize("tag", [LEGACY, TRIGGERED], ids=["legacy", "format"])
def test_triggered_tags_leave_text_free_and_constrain_what_follows_a_trigger(engine, tag):
    compiled = engine.structured.compile(_tag(tag))

    def accepts(text: str) -> bool:
        return xgrammar.GrammarMatcher(compiled).accept_string(text)

    assert accepts('Let me look. <function=get_weather>{"city": "Paris"}</function> Done.')
    assert accepts("No tool needed today.")
    assert not accepts('<function=get_weather>{"town": "Paris"}</function>')
    assert not accepts("<function=get_time>{}</function>")


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"not": {"type": "string"}}, "uses 'not'"),
        ({"type": "string", "maxLength": -1}, "invalid JSON schema"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}},
            "optional properties",
        ),
    ],
)
def test_a_schema_inside_a_tag_meets_the_limits_of_one_sent_alone(engine, schema, fragment):
    legacy = {**LEGACY, "structures": [{**LEGACY["structures"][0], "schema": schema}]}
    nested = json.loads(json.dumps(TRIGGERED))
    nested["format"]["tags"][0]["content"]["json_schema"] = schema
    for tag in (legacy, nested):
        params = SamplingParams(structured_outputs=_tag(tag, "structured_outputs.structural_tag"))
        with pytest.raises(InvalidRequestError, match=fragment) as raised:
            engine.add_request("bad", [1, 2, 3], params)
        assert raised.value.param == "structured_outputs.structural_tag"
    assert not engine.has_unfinished_requests()


def test_a_malformed_tag_is_refused_naming_its_field(engine):
    for tag in ({"structures": [{}]}, {"type": "structural_tag", "format": {"type": "or"}}):
        params = SamplingParams(structured_outputs=_tag(tag))
        with pytest.raises(InvalidRequestError, match="invalid structural tag in response_format"):
            engine.add_request("bad", [1, 2, 3], params)


def test_a_tag_s_parts_are_found_in_either_shape():
    nested = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "regex", "pattern": "[a-z]+"},
                {"type": "grammar", "grammar": 'root ::= "x"'},
                {"type": "const_string", "value": "<sep>"},
                {"type": "any_text", "excludes": ["</t>"]},
                {
                    "type": "tag",
                    "begin": "<t>",
                    "content": {"type": "qwen_xml_parameter", "json_schema": WEATHER},
                    "end": ["</t>", "</T>"],
                },
                {"type": "json_schema", "json_schema": WEATHER},
            ],
        },
    }
    parts = tag_parts(_tag(nested, "p"))
    assert sorted((c.kind, c.spec, c.param) for c in parts.constraints) == sorted(
        [
            ("regex", "[a-z]+", "p"),
            ("grammar", 'root ::= "x"', "p"),
            ("json", json.dumps(WEATHER), "p"),
            ("json", json.dumps(WEATHER), "p"),
        ]
    )
    assert sorted(parts.literals) == sorted(["<sep>", "<t>", "</t>", "</T>"])
    assert parts.excludes == ["</t>"]
    legacy = tag_parts(_tag(LEGACY))
    assert [c.kind for c in legacy.constraints] == ["json"]
    assert legacy.literals == ["<function=get_weather>", "</function>", "<function="]
    assert tag_parts(StructuredOutputs("regex", "a")).constraints == []


def test_a_node_type_xgrammar_does_not_define_is_refused_not_walked_past(engine):
    tag = {"type": "structural_tag", "format": {"type": "novel", "json_schema": {"not": {}}}}
    params = SamplingParams(structured_outputs=_tag(tag))
    with pytest.raises(InvalidRequestError, match="node of type 'novel', which is not supported"):
        engine.add_request("bad", [1, 2, 3], params)


def _refused(engine, tag: dict, fragment: str) -> None:
    params = SamplingParams(structured_outputs=_tag(tag))
    with pytest.raises(InvalidRequestError, match=fragment) as raised:
        engine.add_request("bad", [1, 2, 3], params)
    assert raised.value.param == "response_format"
    assert not engine.has_unfinished_requests()


def test_a_qwen_xml_parameter_schema_meets_the_schema_checks(engine):
    content = {"type": "qwen_xml_parameter", "json_schema": {"not": {"type": "string"}}}
    tag = {"type": "tag", "begin": "<p>", "content": content, "end": "</p>"}
    _refused(engine, {"type": "structural_tag", "format": tag}, "uses 'not'")


def test_a_tag_s_parts_together_meet_the_limits_of_one_schema(engine):
    # Each schema's pattern is within the limit (1,997 written out); two together are not.
    pattern = {"type": "string", "pattern": "^([a-z]{0,20}x){95}$"}
    tags = [
        {
            "type": "tag",
            "begin": f"<f{i}>",
            "end": "</f>",
            "content": {"type": "json_schema", "json_schema": pattern},
        }
        for i in range(2)
    ]
    triggered = {"type": "triggered_tags", "triggers": ["<f"], "tags": tags}
    _refused(engine, {"type": "structural_tag", "format": triggered}, "has patterns of size 3,994")
    many = [{"type": "regex", "pattern": "a"}] * 65
    _refused(
        engine,
        {"type": "structural_tag", "format": {"type": "sequence", "elements": many}},
        "65 schemas, regexes and grammars",
    )
    excludes = {"type": "any_text", "excludes": [f"x{i}" for i in range(65)]}
    _refused(engine, {"type": "structural_tag", "format": excludes}, "65 excludes strings")


def test_text_a_tag_makes_the_output_write_must_be_spellable(engine):
    # SmolLM2's vocabulary has no token for U+0004: a tag requiring it would dead-end mid-output.
    regex = {"type": "regex", "pattern": "a\x04b"}
    _refused(engine, {"type": "structural_tag", "format": regex}, "which no token of this model")
    const = {"type": "const_string", "value": "a\x04b"}
    _refused(engine, {"type": "structural_tag", "format": const}, "which no token of this model")
