"""The offline `LLM` API on the default model: prompts as str, token ids or a list of either; chat
through the tokenizer's template; outputs shaped like vLLM's `RequestOutput`/`CompletionOutput`."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from pagedserve.configs import SamplingParams
from pagedserve.configs.engine import OFFLINE_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.llm import LLM
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tests.engine.conftest import assert_matches_reference, hf_greedy_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(
        model=str(default_model_path),
        num_kv_blocks=256,
        block_size=16,
        dtype="float32",
        device="cpu",
    )


def _check_shape(output: RequestOutput, tokenizer, num_choices: int = 1) -> None:
    assert isinstance(output, RequestOutput) and output.finished
    assert isinstance(output.request_id, str) and output.prompt_token_ids
    assert [choice.index for choice in output.outputs] == list(range(num_choices))
    for choice in output.outputs:
        assert isinstance(choice, CompletionOutput)
        assert choice.finish_reason in ("stop", "length")
        assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)


def test_generate_from_a_string_matches_hf_generate(llm, default_hf_model):
    prompt = "The capital of France is"
    (output,) = llm.generate(prompt, GREEDY)
    _check_shape(output, llm.tokenizer)
    assert output.prompt == prompt and output.prompt_token_ids == llm.tokenizer.encode(prompt)
    choice = output.outputs[0]
    assert (
        len(choice.token_ids) == 8 and choice.finish_reason == "length" and choice.logprobs is None
    )
    reference = hf_greedy_reference(default_hf_model, output.prompt_token_ids, 8)
    assert_matches_reference(choice.token_ids, reference, "LLM.generate")


def test_the_offline_step_budget_is_the_throughput_one_unless_given(llm, default_model_path):
    # The server keeps SchedulerConfig's 512 (short steps for the next arrival); a batch job gets
    # the larger budget, and an explicit one is kept.
    assert SchedulerConfig().max_num_batched_tokens == 512
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    assert budget == OFFLINE_MAX_NUM_BATCHED_TOKENS > 512
    given = LLM(model=str(default_model_path), num_kv_blocks=16, max_num_batched_tokens=64)
    assert given.engine.config.scheduler.max_num_batched_tokens == 64


def test_construction_freezes_the_start_up_objects(default_model_path):
    # Out of the collector's full passes, as the server's (engine/heap.py); conftest thaws.
    built = LLM(model=str(default_model_path), num_kv_blocks=16, max_num_batched_tokens=64)
    assert gc.get_freeze_count() > 0
    assert not any(obj is built.engine.scheduler for obj in gc.get_objects())


def test_generate_from_token_ids_has_no_prompt_text(llm):
    token_ids = llm.tokenizer.encode("Once upon a time")
    (output,) = llm.generate(token_ids, GREEDY)
    _check_shape(output, llm.tokenizer)
    assert output.prompt is None and output.prompt_token_ids == token_ids


def test_generate_a_list_returns_outputs_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["Water boils at", llm.tokenizer.encode("My favourite colour is"), "1, 2, 3,"]
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True),
    ]
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == ["Water boils at", None, "1, 2, 3,"]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 3, 5]
    assert len({o.request_id for o in outputs}) == 3
    for output in outputs:
        _check_shape(output, llm.tokenizer)
    alone = llm.generate("Water boils at", GREEDY)[0].outputs[0].token_ids
    assert outputs[0].outputs[0].token_ids == alone


def test_generate_with_n_and_logprobs_returns_every_choice_with_its_logprobs(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, logprobs=2)
    (output,) = llm.generate("Hello", params)
    _check_shape(output, llm.tokenizer, num_choices=2)
    for choice in output.outputs:
        assert len(choice.logprobs) == len(choice.token_ids) == 4
        for token_id, logprob in zip(choice.token_ids, choice.logprobs, strict=True):
            assert isinstance(logprob, TokenLogprob) and logprob.token_id == token_id
            assert logprob.logprob <= 0.0 and len(logprob.top_logprobs) == 2


def test_stop_string_ends_the_text_before_it(llm):
    full = llm.generate(
        "List three fruits:", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    text = full[0].outputs[0].text
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    (output,) = llm.generate(
        "List three fruits:", SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,))
    )
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == stop
    assert output.outputs[0].text == text[: text.index(stop)]


def test_stop_regex_ends_the_text_at_its_first_match(llm):
    # SGLang's stop_regex: whitespace, the second word's first character, then any other
    # non-space one; the output is cut where that first appears, and the pattern is the reason.
    full = llm.generate(
        "List three fruits:", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    text = full[0].outputs[0].text
    pattern = rf"\s{re.escape(text.split()[1][0])}\S"
    (output,) = llm.generate(
        "List three fruits:",
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_regex=(pattern,)),
    )
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == pattern
    cut = re.search(pattern, text)
    assert cut is not None and output.outputs[0].text == text[: cut.start()]


def test_chat_applies_the_template_with_the_generation_prompt(llm):
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Say hi."},
    ]
    (output,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))
    expected = llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert output.prompt is None and output.prompt_token_ids == list(expected)
    _check_shape(output, llm.tokenizer)
    assert output.outputs[0].text.strip()


def test_chat_accepts_several_conversations(llm):
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Count to three."}],
    ]
    outputs = llm.chat(
        conversations, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(outputs) == 2 and outputs[0].prompt_token_ids != outputs[1].prompt_token_ids
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)


def test_generate_with_prompt_logprobs_and_max_tokens_zero_returns_only_them(llm):
    (output,) = llm.generate("One, two, three", SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    entries = output.prompt_logprobs
    assert len(entries) == len(output.prompt_token_ids) and entries[0] is None
    assert [entry.token_id for entry in entries[1:]] == output.prompt_token_ids[1:]
    assert all(len(entry.top_logprobs) == 2 and entry.rank >= 1 for entry in entries[1:])


def test_embed_gives_each_prompts_normalised_final_hidden_state(llm, default_hf_model):
    prompts = ["The capital of France is", llm.tokenizer.encode("Vectors compare by angle.")]
    outputs = llm.embed(prompts)
    raw = llm.embed(prompts[0], normalize=False)[0].outputs.embedding
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            state = default_hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(state, dim=0)
        assert (torch.tensor(output.outputs.embedding) - want).abs().max().item() < 1e-4
    assert torch.tensor(raw).norm().item() > 2  # not normalised
    assert not llm.engine.has_unfinished_requests()


def test_a_refused_prompt_leaves_nothing_queued(llm):
    too_long = [5] * (llm.engine.max_model_len + 1)
    for call in (lambda: llm.embed(["fine", too_long]), lambda: llm.generate(["fine", too_long])):
        with pytest.raises(InvalidRequestError):
            call()
        assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].finished  # still serves


def test_score_is_the_cosine_of_the_embeddings_for_a_generative_model(llm):
    texts = ["The capital of France is", "Paris is a city."]
    first, second = llm.score(texts[0], texts)
    assert first.outputs.score == pytest.approx(1.0, abs=1e-5)
    a, b = (output.outputs.embedding for output in llm.embed(texts))
    assert second.outputs.score == pytest.approx(sum(x * y for x, y in zip(a, b, strict=True)))
