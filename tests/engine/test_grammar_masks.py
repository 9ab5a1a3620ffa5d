"""The structured-output layer without a model: the mask covers the logits' full width (ids past
the tokenizer always masked), only constrained rows change, and compiles are cached by constraint
on the pool, failures included in no cache."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar

from pagedserve.configs import SamplingParams, StructuredOutputs
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured_outputs import StructuredOutputManager

NUM_PADDED_IDS = 64
CHOICE = StructuredOutputs("choice", ("yes", "no"))


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    # The model's logits are wider than the tokenizer, as with padded embedding tables.
    vocab_size = len(default_tokenizer) + NUM_PADDED_IDS
    return StructuredOutputManager(default_tokenizer, vocab_size, [default_tokenizer.eos_token_id])


def test_mask_covers_the_full_logits_width_and_only_constrained_rows(manager, default_tokenizer):
    [matcher] = manager.new_matchers(
        manager.compile(StructuredOutputs("json_object")), SamplingParams()
    )
    logits = torch.zeros(2, manager.vocab_size)
    manager.apply(logits, [None, matcher])
    assert torch.equal(logits[0], torch.zeros(manager.vocab_size))  # unconstrained: untouched
    allowed = (logits[1] > float("-inf")).nonzero()[:, 0].tolist()
    assert allowed
    assert all(default_tokenizer.decode([token_id]).startswith("{") for token_id in allowed)
    assert bool((logits[1, len(default_tokenizer) :] == float("-inf")).all())  # padded ids
    assert len(manager.mask_times_s) == 1


def test_choice_grammar_allows_only_the_choices_then_only_eos(manager, default_tokenizer):
    [matcher] = manager.new_matchers(manager.compile(CHOICE), SamplingParams())
    for token_id in default_tokenizer.encode("no"):
        assert manager.advance(matcher, token_id)
    logits = torch.zeros(1, manager.vocab_size)
    manager.apply(logits, [matcher])
    assert (logits[0] > float("-inf")).nonzero()[:, 0].tolist() == [default_tokenizer.eos_token_id]
    assert not manager.advance(matcher, default_tokenizer.encode("x")[0])
    assert manager.advance(matcher, default_tokenizer.eos_token_id)
    assert manager.is_complete(matcher)


def test_compiles_are_cached_by_constraint_not_by_parameter(manager):
    first = manager.compiler.submit(StructuredOutputs("regex", "[ab]+", "guided_regex"))
    again = manager.compiler.submit(StructuredOutputs("regex", "[ab]+", "structured_outputs.regex"))
    assert first is again
    assert first.result() is again.result()


def test_failed_compiles_are_not_cached(manager):
    bad = StructuredOutputs("regex", "(unclosed", "guided_regex")
    first = manager.compiler.submit(bad)
    with pytest.raises(InvalidRequestError, match="regex"):
        first.result()
    assert manager.compiler.submit(bad) is not first


@pytest.mark.parametrize(
    ("constraint", "char"),
    [
        (StructuredOutputs("regex", "s\U00084d45\x88", "guided_regex"), "U+84D45"),  # byte 0xF2
        (StructuredOutputs("regex", r"ab\x04", "guided_regex"), "U+0004"),
        (StructuredOutputs("regex", r"(ab)+\u0006c", "guided_regex"), "U+0006"),
        (StructuredOutputs("regex", r"[a-z]*\u{40000}", "guided_regex"), "U+40000"),
        (StructuredOutputs("choice", ("yes", "n\x13")), "U+0013"),
        (StructuredOutputs("grammar", 'root ::= "a" "\\x1d"', "guided_grammar"), "U+001D"),
        (
            StructuredOutputs("grammar", 'root ::= "[" x\nx ::= "\x04" "]"', "guided_grammar"),
            "U+0004",
        ),
    ],
)
def test_a_constraint_that_needs_a_character_the_vocabulary_cannot_spell_is_refused(
    manager, constraint, char
):
    # SmolLM2's vocabulary holds no token with these bytes: the model could start the output,
    # then find no token (a dead end), so the request is refused up front, naming the character.
    with pytest.raises(InvalidRequestError, match=re.escape(f"requires {char},")) as raised:
        manager.compile(constraint)
    assert raised.value.param == constraint.param


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("regex", r"[a\x04]b"),  # a class: the mask never offers the missing byte
        ("regex", "a\x04?"),
        ("regex", r"a\x04*b"),
        ("regex", r"a\x04{0,2}b"),
        ("regex", r"a|b\x04"),  # alternatives and groups are left to run time
        ("regex", r"(\x04)?b"),
        ("regex", r"\w+\d\s[^\]]"),
        ("regex", "é😀"),
        ("choice", ("yes", "\x04")),  # a choice that cannot start is never taken
        ("choice", ("ab", "a\x13", "a\x14c")),  # after "a", "b" is always open
        ("grammar", 'root ::= "a" | "\\x04"'),
        ("grammar", 'root ::= "a" "\\x04"?'),
        ("grammar", 'root ::= "a" # not \\x04\n'),
    ],
)
def test_an_unspellable_character_the_output_can_avoid_is_allowed(manager, kind, spec):
    manager.compile(StructuredOutputs(kind, spec, "structured_outputs"))


def test_a_constraint_with_no_first_token_is_refused(manager):
    # A class of unspellable characters: nothing is "required" by name, yet nothing can start.
    constraint = StructuredOutputs("regex", r"[\x04\x06]", "guided_regex")
    with pytest.raises(InvalidRequestError, match="allows no token .* as its first"):
        manager.compile(constraint)


def _object(num_properties: int, required: int = 0) -> dict:
    names = [f"p{i}" for i in range(num_properties)]
    return {
        "type": "object",
        "properties": {name: {"type": "string"} for name in names},
        "required": names[:required],
    }


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (_object(300), "has an object of 300 optional properties; at most 256"),
        (
            {"type": "object", "properties": {f"o{j}": _object(200) for j in range(6)}},
            "has 1,206 optional properties; at most 1,024",
        ),
        (_object(2100, required=2100), "has 2,100 properties; at most 2,048"),
        (_nested_arrays(200), "nests 201 levels deep; at most 128"),
        ({"enum": ["x" * 1000] * 140}, "characters long; at most 131,072"),
        (  # 3.4 s to compile inside a schema, 0.06 s as a regex alone
            {"type": "string", "pattern": "^([a-z]{0,20}x){120}$"},
            "has patterns of size 2,522; at most 2,000",
        ),
    ],
)
def test_a_schema_beyond_the_compile_limits_is_refused_before_compiling(manager, schema, problem):
    # Each would hold a compile thread for seconds to minutes (engine/structured_outputs/limits.py).
    constraint = StructuredOutputs("json", json.dumps(schema), "response_format")
    with pytest.raises(InvalidRequestError, match=re.escape(problem)) as raised:
        manager.compile(constraint)
    assert raised.value.param == "response_format"


def test_long_regexes_and_choice_lists_are_refused_too(manager):
    with pytest.raises(InvalidRequestError, match="regex in guided_regex is 140,000 characters"):
        manager.compile(StructuredOutputs("regex", "a" * 140_000, "guided_regex"))
    choices = tuple(f"{i:07d}" for i in range(20_000))
    with pytest.raises(InvalidRequestError, match="choice in guided_choice is 140,000 characters"):
        manager.compile(StructuredOutputs("choice", choices, "guided_choice"))


def test_schemas_at_the_limits_compile(manager):
    email = {"type": "string", "pattern": r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$"}
    padded = {"type": "string", "pattern": "^[a-z]{0,1990}$"}
    for schema in (
        _object(256),
        _object(2048, required=2048 - 256),
        _nested_arrays(127),
        email,
        padded,
    ):
        manager.compile(StructuredOutputs("json", json.dumps(schema), "response_format"))


# Schemas using a keyword xgrammar 0.2 compiles without enforcing, each with a value that breaks
# the schema and that xgrammar's own matcher still accepts (compact JSON, xgrammar's separators).
UNENFORCED = [
    ({"type": "integer", "not": {"const": 3}}, "3", "'not'"),
    ({"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 3}]}, "4", "'allOf' of more"),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]},
        },
        '{"a": 1}',
        "'if' / 'then' / 'else'",
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "[1, 1]",
        "'uniqueItems'",
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
        "[1]",
        "'contains'",
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
        "'dependentRequired'",
    ),
    ({"$ref": "https://example.com/integer.json"}, '"not fetched"', "a '$ref' outside"),
]


@pytest.mark.parametrize(("schema", "breaking", "keyword"), UNENFORCED)
def test_xgrammar_still_compiles_these_keywords_without_enforcing_them(
    manager, default_tokenizer, schema, breaking, keyword
):
    # The reason for the refusal below; fails once an xgrammar upgrade enforces the keyword.
    compiled = manager.compiler._xgrammar_compiler().compile_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string(breaking) and matcher.accept_token(default_tokenizer.eos_token_id)


@pytest.mark.parametrize(("schema", "breaking", "keyword"), UNENFORCED)
def test_a_schema_the_compiler_would_not_enforce_is_refused_naming_the_keyword(
    manager, schema, breaking, keyword
):
    nested = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    for spec in (schema, nested):
        constraint = StructuredOutputs("json", json.dumps(spec), "guided_json")
        with pytest.raises(InvalidRequestError, match=re.escape(keyword)) as raised:
            manager.compile(constraint)
        assert raised.value.param == "guided_json"


def test_keywords_the_compiler_enforces_pass_even_under_those_names(manager):
    schema = {
        "$defs": {"n": {"type": "integer"}},
        "type": "object",
        "properties": {"not": {"allOf": [{"$ref": "#/$defs/n"}]}, "if": {"type": "string"}},
        "required": ["not", "if"],
    }
    manager.compile(StructuredOutputs("json", json.dumps(schema), "guided_json"))


# Invalid schemas xgrammar 0.2.9 compiles as some valid one (engine/structured_outputs/
# schema_support.py): each is refused with a 400 naming the keyword.
MISREAD = [
    ({"type": "string", "maxLength": -1}, "'maxLength' is -1;"),  # read as no bound
    ({"type": "array", "items": {"type": "integer"}, "minItems": -2}, "'minItems' is -2;"),
    ({"type": "array", "maxItems": 4294967297}, "'maxItems' is 4294967297;"),  # read as 1
    ({"anyOf": []}, "'anyOf' is empty"),  # read as "only the end"
    ({"allOf": []}, "'allOf' is empty"),  # read as "anything"
]


@pytest.mark.parametrize(("schema", "problem"), MISREAD)
def test_xgrammar_still_compiles_these_invalid_schemas(manager, schema, problem):
    # The reason for the refusal below; fails once an xgrammar upgrade refuses them itself.
    manager.compiler._xgrammar_compiler().compile_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )


@pytest.mark.parametrize(("schema", "problem"), MISREAD)
def test_an_invalid_schema_the_compiler_would_misread_is_refused(manager, schema, problem):
    nested = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    for spec in (schema, nested):
        with pytest.raises(InvalidRequestError, match=re.escape(problem)) as raised:
            manager.compile(StructuredOutputs("json", json.dumps(spec), "response_format"))
        assert raised.value.param == "response_format"


def test_xgrammar_wraps_repeat_counts_past_2_to_the_31(manager, default_tokenizer):
    # The reason for the refusal below: `a{4294967296}` compiles as `a{0}`.
    compiled = manager.compiler._xgrammar_compiler().compile_regex("a{4294967296}")
    assert xgrammar.GrammarMatcher(compiled).accept_token(default_tokenizer.eos_token_id)


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs("regex", "[ab]{4294967296}", "guided_regex"),
        StructuredOutputs("regex", "a{1," + "9" * 5000 + "}", "guided_regex"),
        StructuredOutputs("grammar", 'root ::= "a"{2147483648}', "guided_grammar"),
        StructuredOutputs(
            "json", json.dumps({"type": "string", "pattern": "^x{4294967296}$"}), "response_format"
        ),
    ],
)
def test_a_repeat_past_the_compilers_count_is_refused(manager, constraint):
    with pytest.raises(InvalidRequestError, match="more than 2,147,483,647 times") as raised:
        manager.compile(constraint)
    assert raised.value.param == constraint.param


def test_repeats_within_the_count_and_braces_that_are_not_repeats_compile(manager):
    for constraint in (
        StructuredOutputs("regex", r"a{2147483647}|\{99999999999\}|[{]9999999999[}]"),
        StructuredOutputs("grammar", 'root ::= "{99999999999}" [a]{2147483647}  # {99999999999}'),
    ):
        manager.compile(constraint)
