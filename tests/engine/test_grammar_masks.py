"""The structured-output layer without a model: the mask covers the logits' full width (ids past
the tokenizer always masked), only constrained rows change, and compiles are cached by constraint
on the pool, failures included in no cache."""

from __future__ import annotations

import pytest
import torch

from pagedserve.configs import StructuredOutputs
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
    [matcher] = manager.new_matchers(manager.compile(StructuredOutputs("json_object")), 1)
    logits = torch.zeros(2, manager.vocab_size)
    manager.apply(logits, [None, matcher])
    assert torch.equal(logits[0], torch.zeros(manager.vocab_size))  # unconstrained: untouched
    allowed = (logits[1] > float("-inf")).nonzero()[:, 0].tolist()
    assert allowed
    assert all(default_tokenizer.decode([token_id]).startswith("{") for token_id in allowed)
    assert bool((logits[1, len(default_tokenizer) :] == float("-inf")).all())  # padded ids
    assert len(manager.mask_times_s) == 1


def test_choice_grammar_allows_only_the_choices_then_only_eos(manager, default_tokenizer):
    [matcher] = manager.new_matchers(manager.compile(CHOICE), 1)
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
