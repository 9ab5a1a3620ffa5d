"""A constraint that leaves the think block free (`StructuredOutputs.think`), through the real
engine on the default model: inside the block any token goes (the grammar would forbid them), the
grammar holds from the token after the closing tag, and a reply may open the block with its
first token only. The default model has no think tags, so two ordinary tokens play them, and
logit_bias steers greedy decoding where a test needs the model to choose a tag."""

from __future__ import annotations

import re

import pytest
import xgrammar

from pagedserve.configs import SamplingParams, StructuredOutputs, ThinkBlock
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured_outputs.think_gate import ThinkGatedMatcher
from tests.engine.conftest import make_engine, run_to_completion

DIGITS = r"[0-9]{1,4}"


@pytest.fixture(scope="module")
def engine(default_loaded):
    return make_engine(default_loaded, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def ids(engine):
    def one(text: str) -> int:
        (token_id,) = engine.tokenizer.encode(text, add_special_tokens=False)
        return token_id

    return {"free": one("x"), "open": one("<"), "close": one(">")}


def _run(engine, ids, think: ThinkBlock | None, bias: dict[str, float], max_tokens: int = 6):
    prompt = engine.tokenizer.encode("Pick a number:")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        logit_bias={ids[name]: value for name, value in bias.items()},
        structured_outputs=StructuredOutputs("regex", DIGITS, think=think),
    )
    engine.add_request("r", prompt, params)
    run = run_to_completion(engine)
    return run.token_ids["r"], run.finish_reasons["r"]


def test_inside_the_block_the_grammar_waits(engine, ids):
    think = ThinkBlock(ids["open"], ids["close"], inside=True)
    tokens, reason = _run(engine, ids, think, {"free": 30})
    assert tokens == [ids["free"]] * 6 and reason == "length"  # free text, never masked
    without, _ = _run(engine, ids, None, {"free": 30})
    assert ids["free"] not in without  # the same request, constrained from its first token


def test_after_the_closing_tag_the_grammar_holds(engine, ids):
    think = ThinkBlock(ids["open"], ids["close"], inside=True)
    tokens, reason = _run(engine, ids, think, {"close": 40, "free": 30}, max_tokens=12)
    assert tokens[0] == ids["close"]
    answer = engine.tokenizer.decode(tokens[1:], skip_special_tokens=True)
    assert re.fullmatch(DIGITS, answer) and reason == "stop"  # the tag is masked again after


def test_a_reply_may_open_the_block_with_its_first_token(engine, ids):
    think = ThinkBlock(ids["open"], ids["close"])
    tokens, reason = _run(engine, ids, think, {"open": 40, "free": 30})
    assert tokens == [ids["open"]] * 6 and reason == "length"  # then "<" is free text


@pytest.mark.parametrize("bias", [{"free": 30}, {"close": 40}], ids=["free", "close"])
def test_a_reply_that_does_not_open_the_block_is_constrained_throughout(engine, ids, bias):
    tokens, reason = _run(engine, ids, ThinkBlock(ids["open"], ids["close"]), bias, max_tokens=12)
    assert re.fullmatch(DIGITS, engine.tokenizer.decode(tokens, skip_special_tokens=True))
    assert reason == "stop"


def test_the_opening_tag_is_allowed_first_only(engine):
    # Tag ids on bit 31 of a mask word (its sign bit) and elsewhere.
    grammar = engine.structured.compile(StructuredOutputs("regex", DIGITS))
    digit = engine.tokenizer.encode("7", add_special_tokens=False)[0]
    for open_id in (31, 32 * 40 + 31, 32 * 40 + 3):
        matcher = ThinkGatedMatcher(xgrammar.GrammarMatcher(grammar), ThinkBlock(open_id, 0))
        mask = xgrammar.allocate_token_bitmask(1, engine.vocab_size)

        def allowed(token_id: int, mask=mask) -> bool:
            return bool(mask[0, token_id // 32].item() >> (token_id % 32) & 1)

        matcher.fill_next_token_bitmask(mask, 0)
        assert allowed(open_id) and allowed(digit)
        assert matcher.accept_token(digit)  # the answer began: no block any more
        matcher.fill_next_token_bitmask(mask, 0)
        assert not allowed(open_id) and allowed(digit)
        assert not matcher.accept_token(open_id)


def test_tags_outside_the_vocabulary_are_refused(engine, ids):
    think = ThinkBlock(engine.vocab_size, ids["close"])
    params = SamplingParams(structured_outputs=StructuredOutputs("regex", DIGITS, think=think))
    with pytest.raises(InvalidRequestError, match="think block"):
        engine.add_request("bad", [1, 2, 3], params)
    assert not engine.has_unfinished_requests()


def test_the_states_follow_the_tags(engine, ids):
    grammar = engine.structured.compile(StructuredOutputs("regex", DIGITS))
    matcher = ThinkGatedMatcher(
        xgrammar.GrammarMatcher(grammar), ThinkBlock(ids["open"], ids["close"])
    )
    assert matcher.masks_next_token
    assert matcher.accept_token(ids["open"]) and not matcher.masks_next_token
    for token_id in (ids["free"], ids["open"], ids["free"]):  # anything, the opening tag too
        assert matcher.accept_token(token_id) and not matcher.masks_next_token
    assert matcher.accept_token(ids["close"]) and matcher.masks_next_token
    assert not matcher.is_terminated()
    assert not matcher.accept_token(ids["open"])  # the answer's grammar: no second block
