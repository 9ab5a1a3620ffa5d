"""Structured outputs through the real engine on the default model: every constrained output
matches its constraint, unconstrained neighbours are untouched, and the grammar state survives
recompute preemption, n > 1 and a dead end (which ends the choice with an error, never a hang)."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from pagedserve.configs import SamplingParams, StructuredOutputs
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured_outputs import manager as manager_module
from tests.engine.conftest import make_engine, run_to_completion

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
PERSON = StructuredOutputs("json", json.dumps(PERSON_SCHEMA))
MAX_TOKENS = 48  # the schema's longest output is under 40 tokens


def _prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _constrained(constraint: StructuredOutputs, **settings: object) -> SamplingParams:
    settings.setdefault("temperature", 0.0)
    settings.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=constraint, **settings)


@pytest.fixture(scope="module")
def engine(default_loaded):
    return make_engine(default_loaded, num_kv_blocks=256, block_size=16)


def test_engine_json_schema_output_validates_and_stops(engine):
    prompt = _prompt(engine.tokenizer, "Describe a person as JSON.")
    engine.add_request("p", prompt, _constrained(PERSON))
    run = run_to_completion(engine)
    jsonschema.validate(json.loads(run.texts["p"]), PERSON_SCHEMA)
    assert run.finish_reasons["p"] == "stop"


def test_engine_constrained_and_unconstrained_requests_batched_each_get_what_they_asked(engine):
    free_prompt = _prompt(engine.tokenizer, "Name three colors.")
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("alone", free_prompt, free)
    alone = run_to_completion(engine).token_ids["alone"]

    engine.add_request("free", free_prompt, free)
    engine.add_request(
        "json", _prompt(engine.tokenizer, "A person, as JSON:"), _constrained(PERSON)
    )
    engine.add_request("choice", free_prompt, _constrained(StructuredOutputs("choice", ("x", "y"))))
    engine.add_request(
        "regex", free_prompt, _constrained(StructuredOutputs("regex", r"[0-9]{3}-[a-c]{2}"))
    )
    run = run_to_completion(engine)
    assert run.token_ids["free"] == alone
    jsonschema.validate(json.loads(run.texts["json"]), PERSON_SCHEMA)
    assert run.texts["choice"] in ("x", "y")
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", run.texts["regex"])
    assert {run.finish_reasons[key] for key in ("json", "choice", "regex")} == {"stop"}


@pytest.mark.slow
def test_engine_constrained_request_survives_recompute_preemption(default_loaded):
    # 12 blocks of 4 tokens: two ~30-token prompts plus their outputs cannot both stay resident.
    engine = make_engine(default_loaded, num_kv_blocks=24, block_size=4, max_num_batched_tokens=64)
    prompts = [
        _prompt(engine.tokenizer, "A person, as JSON:"),
        _prompt(engine.tokenizer, "Describe somebody as JSON."),
    ]
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, _constrained(PERSON))
    run = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    for index in range(len(prompts)):
        jsonschema.validate(json.loads(run.texts[f"r{index}"]), PERSON_SCHEMA)
        assert run.finish_reasons[f"r{index}"] == "stop"


@pytest.mark.slow
def test_engine_n3_sampled_choices_each_follow_their_own_grammar(engine):
    prompt = _prompt(engine.tokenizer, "Describe a person as JSON.")
    engine.add_request("n3", prompt, _constrained(PERSON, n=3, temperature=1.0, seed=11))
    run = run_to_completion(engine)
    texts = [run.texts["n3"], run.texts[("n3", 1)], run.texts[("n3", 2)]]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert len(set(texts)) > 1  # independent samples, not one matcher shared
    assert set(run.finish_reasons.values()) == {"stop"}


def test_engine_grammar_complete_under_ignore_eos_stops(engine):
    prompt = _prompt(engine.tokenizer, "Yes or no?")
    constraint = StructuredOutputs("choice", ("yes", "no"))
    engine.add_request("c", prompt, _constrained(constraint, ignore_eos=True))
    run = run_to_completion(engine)
    assert run.texts["c"] in ("yes", "no")
    assert run.finish_reasons["c"] == "stop"


def test_engine_max_tokens_cuts_a_constrained_choice_with_length(engine):
    engine.add_request("cut", [1, 2, 3], _constrained(PERSON, max_tokens=3))
    run = run_to_completion(engine)
    assert run.finish_reasons["cut"] == "length"
    assert len(run.token_ids["cut"]) == 3


def test_engine_grammar_complete_before_min_tokens_stops_there(engine):
    # After "a" the grammar allows only EOS, which min_tokens would ban: the constraint's end
    # wins (the output is complete), rather than a step with no allowed token and an error.
    constraint = StructuredOutputs("choice", ("a",))
    engine.add_request("short", [1, 2, 3], _constrained(constraint, min_tokens=4))
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    run = run_to_completion(engine)
    assert (run.texts["short"], run.finish_reasons["short"]) == ("a", "stop")
    assert run.finish_reasons["ok"] == "length"


def test_engine_a_grammar_dead_end_ends_that_choice_with_error(engine):
    # The pattern needs U+0004, which no token spells; JSON schemas are not scanned for it, so
    # the model writes '"a' and then has no allowed token: that choice ends, nothing hangs.
    schema = json.dumps({"type": "string", "pattern": "^a\\u0004$"})
    engine.add_request("dead", [1, 2, 3], _constrained(StructuredOutputs("json", schema)))
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    run = run_to_completion(engine)
    assert run.finish_reasons["dead"] == "error"
    assert run.texts["dead"] == '"a'
    assert run.finish_reasons["ok"] == "length"  # run_to_completion also checks for leaks


def test_engine_a_grammar_too_slow_to_mask_ends_that_choice_and_spares_the_batch(
    engine, monkeypatch
):
    # An ambiguous grammar can make each step's mask cost more than the last (limits.py); the
    # choice whose fill passes MAX_MASK_FILL_S ends with "error" after that step. Set to 0 here,
    # so the first fill passes it.
    monkeypatch.setattr(manager_module, "MAX_MASK_FILL_S", 0.0)
    grammar = 'root ::= s\ns ::= s s s | s s | [a-z ] | ""'
    constraint = StructuredOutputs("grammar", grammar, "guided_grammar")
    engine.add_request("slow", [1, 2, 3], _constrained(constraint, max_tokens=8))
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({delta.request_id: delta for delta in engine.step() if delta.finished})
    assert finals["slow"].finish_reason == "error" and finals["slow"].num_output_tokens == 0
    assert "to mask one token (at most 0 ms" in finals["slow"].error
    assert finals["ok"].finish_reason == "length" and finals["ok"].num_output_tokens == 4
    assert engine.block_manager.pool.num_free_blocks == engine.block_manager.pool.num_blocks


@pytest.mark.parametrize(
    ("constraint", "fragment"),
    [
        (StructuredOutputs("json", '{"type": "foo"}', "response_format"), "JSON schema"),
        (StructuredOutputs("json", "{not json", "guided_json"), "JSON schema"),
        (StructuredOutputs("regex", "[a-", "guided_regex"), "regex"),
        (StructuredOutputs("grammar", 'root ::= "a" |', "guided_grammar"), "grammar"),
    ],
)
def test_engine_refuses_a_malformed_constraint_naming_its_parameter(engine, constraint, fragment):
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request("bad", [1, 2, 3], _constrained(constraint))
    assert raised.value.param == constraint.param
    assert fragment in str(raised.value) and "/project/" not in str(raised.value)
    assert not engine.has_unfinished_requests()


def test_engine_logprobs_see_the_constrained_distribution(engine):
    # Masking happens before sampling: the reported distribution holds only grammar tokens.
    constraint = StructuredOutputs("choice", ("yes", "no"))
    engine.add_request("lp", [1, 2, 3], _constrained(constraint, logprobs=20, max_tokens=4))
    first = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            first = first or (delta.new_logprobs or (None,))[0]
    assert first is not None
    alternatives = [(t, lp) for t, lp in first.top_logprobs if lp > float("-inf")]
    assert sum(math.exp(lp) for _, lp in alternatives) == pytest.approx(1.0, abs=1e-4)
    for token_id, _ in alternatives:
        piece = engine.tokenizer.decode([token_id])
        assert "yes".startswith(piece) or "no".startswith(piece), piece
