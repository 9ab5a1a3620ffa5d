"""Embeddings through the real engine (engine/embeddings.py): the state a request gets is the
final hidden state Hugging Face's model computes at the prompt's last token, whether its step
kept only the logits rows or ran the norm over every token, batched with generation (which
stays token-identical), from a prefix-cache hit, and after chunked prefill; on other families
too."""

from __future__ import annotations

import pytest
import torch

from pagedserve.configs import SamplingParams, SamplingParamsError
from pagedserve.engine.errors import InvalidRequestError
from tests.engine.conftest import (
    assert_matches_reference,
    hf_greedy_reference,
    make_engine,
    make_tiny_model,
    run_to_completion,
)

EMBED = SamplingParams(max_tokens=1, temperature=0.0, embed=True)


def _reference(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.get_decoder()(torch.tensor([prompt])).last_hidden_state[0, -1]


def _embeddings(engine, prompts: dict[str, list[int]], others: dict | None = None) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, EMBED)
    for request_id, (prompt, params) in (others or {}).items():
        engine.add_request(request_id, prompt, params)
    found, tokens = {}, {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.embedding is not None:
                assert delta.finished and delta.request_id not in found
                found[delta.request_id] = torch.tensor(delta.embedding)
    assert set(found) == set(prompts)
    return found | {"tokens": tokens}


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_embeddings_are_hf_final_hidden_states_beside_generation(
    default_loaded, default_hf_model, default_tokenizer
):
    engine = make_engine(default_loaded, num_kv_blocks=256)
    prompts = {
        "one": default_tokenizer.encode("The capital of France is"),
        "two": default_tokenizer.encode("Embeddings map text to vectors that compare by angle."),
        "single": [default_tokenizer.encode("Hi")[0]],  # one token: its step keeps every row
    }
    story = default_tokenizer.encode("Once upon a time")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    found = _embeddings(engine, prompts, {"story": (story, greedy)})
    for request_id, prompt in prompts.items():
        _assert_close(found[request_id], _reference(default_hf_model, prompt))
    reference = hf_greedy_reference(default_hf_model, story, 6)
    assert_matches_reference(found["tokens"]["story"], reference, "generation beside embeddings")
    single = make_engine(default_loaded, num_kv_blocks=64)  # alone: no kept rows at all
    alone = _embeddings(single, {"single": prompts["single"]})["single"]
    _assert_close(alone, _reference(default_hf_model, prompts["single"]))


def test_a_cached_prefix_and_chunked_prefill_give_the_same_embedding(
    default_loaded, default_hf_model, default_tokenizer
):
    engine = make_engine(default_loaded, num_kv_blocks=256, max_num_batched_tokens=32)
    prompt = default_tokenizer.encode("A long shared prefix, told again and again. " * 6)
    assert len(prompt) > 32  # prefilled in chunks
    first = _embeddings(engine, {"first": prompt})["first"]
    engine.add_request("again", prompt, EMBED)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    [final] = [delta for delta in deltas if delta.finished]
    assert final.num_cached_prompt_tokens > 0  # served from the prefix cache
    want = _reference(default_hf_model, prompt)
    _assert_close(first, want)
    _assert_close(torch.tensor(final.embedding), want)


@pytest.mark.parametrize("family", ["qwen3-gqa", "qwen2-gqa"])
def test_other_families_embed_as_hugging_face(default_tokenizer, family):
    engine = make_engine(make_tiny_model(family, default_tokenizer, seed=3), block_size=4)
    prompt = list(range(5, 23))
    found = _embeddings(engine, {"p": prompt})["p"]
    # The engine swaps modules of the model it serves: the reference is the same weights as
    # loaded before any swap.
    reference = make_tiny_model(family, default_tokenizer, seed=3).model
    _assert_close(found, _reference(reference, prompt))


def test_an_embedding_request_is_one_choice_of_one_token():
    with pytest.raises(SamplingParamsError, match="one token"):
        SamplingParams(max_tokens=2, embed=True)
    with pytest.raises(SamplingParamsError, match="one choice"):
        SamplingParams(max_tokens=1, n=2, embed=True)


def test_a_model_without_a_final_norm_refuses_embeddings(default_loaded):
    engine = make_engine(default_loaded, num_kv_blocks=64)
    engine.runner.hidden.available = False  # as for a model whose final norm is not found
    with pytest.raises(InvalidRequestError, match="no final norm") as error:
        engine.add_request("e", [1, 2, 3], EMBED)
    assert error.value.param == "model"
    run_to_completion(engine)
