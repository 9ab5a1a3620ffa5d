"""End to end: `python -m pagedserve.server serve` with the real default model on 127.0.0.1, driven by the
official `openai` client (and raw httpx where the wire format matters). Greedy results must equal
the offline `LLM`'s; every bad request gets its documented 4xx and OpenAI error body; SIGTERM (last
test) must end an open stream with a final event and exit 0.

One server per module. Torch runs one thread in both processes (`OMP_NUM_THREADS=1` unless set):
on a small, shared machine OpenMP threads that spin against other jobs are ~10x slower.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

API_KEY = "test-key"
ENGINE_FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "256", "--block-size", "16")
MAX_MODEL_LEN = 1024
REQUEST_TIMEOUT_S = 120
NUM_GREEDY_TOKENS = 16
COMPLETION_PROMPTS = ("The capital of France is", "One, two, three,", "def fibonacci(n):")
CONVERSATIONS = (
    [{"role": "user", "content": "Name three colors."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the opposite of hot?"},
    ],
)
AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server_process() -> Iterator[ServerProcess]:
    """Launched, not yet waited for: the offline results are computed while it loads."""
    process = ServerProcess(
        *ENGINE_FLAGS,
        "--api-key",
        API_KEY,
        "--timeout-graceful-shutdown",
        "2",
        wait=False,
        log_level="info",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def offline(server_process) -> dict[str, Any]:
    """Greedy results of the offline `LLM` (same engine settings) for the prompts and chats."""
    import torch

    from pagedserve.configs import SamplingParams
    from pagedserve.engine.llm import LLM

    num_threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        llm = LLM(max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, block_size=16, dtype="float32")
        params = SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS)
        completions = llm.generate(list(COMPLETION_PROMPTS), params)
        chats = llm.chat([list(conversation) for conversation in CONVERSATIONS], params)
    finally:
        torch.set_num_threads(num_threads)
    return {"completions": completions, "chats": chats}


@pytest.fixture(scope="module")
def server(server_process: ServerProcess) -> tuple[str, subprocess.Popen]:
    server_process.wait_until_healthy()
    return server_process.url, server_process.process


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _in_parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls concurrently (so the engine batches them); results in call order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def _stop_string_in(text: str) -> str:
    """A stop string that first occurs in the middle of `text` (not at its start)."""
    words = text.split()
    assert len(words) >= 3, f"need a few words to pick a stop string from: {text!r}"
    stop = " " + words[len(words) // 2]
    assert text.find(stop) > 0, (text, stop)
    return stop


# --- greedy results equal the offline LLM's ------------------------------------------------------


def test_greedy_completions_equal_the_offline_llm_text_and_token_counts(client, model, offline):
    def complete(prompt: str, n: int = 1) -> Any:
        return client.completions.create(
            model=model, prompt=prompt, n=n, temperature=0, max_tokens=NUM_GREEDY_TOKENS
        )

    responses = _in_parallel(
        *[lambda p=prompt: complete(p) for prompt in COMPLETION_PROMPTS],
        lambda: complete(COMPLETION_PROMPTS[0], n=2),
    )
    for response, expected in zip(responses, offline["completions"], strict=False):
        (choice,) = response.choices
        (output,) = expected.outputs
        assert choice.text == output.text, expected.prompt
        assert choice.finish_reason == output.finish_reason
        assert response.usage.completion_tokens == len(output.token_ids)
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    greedy_twice = responses[-1]
    assert [choice.index for choice in greedy_twice.choices] == [0, 1]
    expected_text = offline["completions"][0].outputs[0].text
    assert [choice.text for choice in greedy_twice.choices] == [expected_text] * 2
    assert greedy_twice.usage.completion_tokens == 2 * len(
        offline["completions"][0].outputs[0].token_ids
    )


def test_greedy_chat_equals_the_offline_llm_chat_and_uses_the_same_prompt_tokens(
    client, model, offline, server
):
    responses = _in_parallel(
        *[
            lambda c=conversation: client.chat.completions.create(
                model=model, messages=c, temperature=0, max_tokens=NUM_GREEDY_TOKENS
            )
            for conversation in CONVERSATIONS
        ]
    )
    for conversation, response, expected in zip(
        CONVERSATIONS, responses, offline["chats"], strict=True
    ):
        (output,) = expected.outputs
        assert response.choices[0].message.role == "assistant"
        assert response.choices[0].message.content == output.text
        assert response.choices[0].finish_reason == output.finish_reason
        assert response.usage.completion_tokens == len(output.token_ids)
        tokenized = httpx.post(
            f"{server[0]}/tokenize",
            json={"messages": conversation},
            headers=AUTH,
            timeout=REQUEST_TIMEOUT_S,
        ).json()
        assert tokenized["tokens"] == expected.prompt_token_ids
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


# --- streaming, n, stop strings -------------------------------------------------------------------


def test_streamed_text_equals_the_offline_text_and_ends_with_a_usage_chunk(client, model, offline):
    def stream_completion() -> list[Any]:
        return list(
            client.completions.create(
                model=model,
                prompt=COMPLETION_PROMPTS[1],
                temperature=0,
                max_tokens=NUM_GREEDY_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )

    def stream_chat() -> list[Any]:
        return list(
            client.chat.completions.create(
                model=model,
                messages=CONVERSATIONS[0],
                temperature=0,
                max_tokens=NUM_GREEDY_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )

    completion_chunks, chat_chunks = _in_parallel(stream_completion, stream_chat)
    expected_completion = offline["completions"][1].outputs[0]
    *text_chunks, usage_chunk = completion_chunks
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == expected_completion.text
    assert text_chunks[-1].choices[0].finish_reason == expected_completion.finish_reason
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(expected_completion.token_ids)

    expected_chat = offline["chats"][0].outputs[0]
    *delta_chunks, usage_chunk = chat_chunks
    assert delta_chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in delta_chunks)
    assert content == expected_chat.text
    assert delta_chunks[-1].choices[0].finish_reason == expected_chat.finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(
        expected_chat.token_ids
    )
    assert usage_chunk.usage.total_tokens == (
        usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    )


def test_streams_without_include_usage_carry_no_usage(client, model):
    chunks = list(
        client.completions.create(
            model=model, prompt="Hello", max_tokens=3, temperature=0, stream=True
        )
    )
    assert chunks and all(chunk.usage is None and len(chunk.choices) == 1 for chunk in chunks)


def test_streamed_chat_with_n_2_finishes_both_choices(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=CONVERSATIONS[0],
            n=2,
            temperature=1,
            seed=3,
            max_tokens=6,
            stream=True,
        )
    )
    finish_reasons: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finish_reasons[choice.index].append(choice.finish_reason)
    assert all(len(reasons) == 1 for reasons in finish_reasons.values()), finish_reasons


def test_stop_strings_end_the_text_before_the_stop_string(client, model, offline):
    full_completion = offline["completions"][1].outputs[0].text
    full_chat = offline["chats"][0].outputs[0].text
    completion_stop, chat_stop = _stop_string_in(full_completion), _stop_string_in(full_chat)

    def complete(**extra: Any) -> Any:
        return client.completions.create(
            model=model,
            prompt=COMPLETION_PROMPTS[1],
            temperature=0,
            max_tokens=NUM_GREEDY_TOKENS,
            **extra,
        )

    plain, included, streamed, chat = _in_parallel(
        lambda: complete(stop=[completion_stop, "never-generated"]),
        lambda: complete(stop=completion_stop, extra_body={"include_stop_str_in_output": True}),
        lambda: list(complete(stop=completion_stop, stream=True)),
        lambda: client.chat.completions.create(
            model=model,
            messages=CONVERSATIONS[0],
            temperature=0,
            max_tokens=NUM_GREEDY_TOKENS,
            stop=chat_stop,
        ),
    )
    cut = full_completion.find(completion_stop)
    assert plain.choices[0].text == full_completion[:cut]
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].stop_reason == completion_stop  # vLLM's field: the string matched
    assert included.choices[0].text == full_completion[: cut + len(completion_stop)]
    assert "".join(chunk.choices[0].text for chunk in streamed) == full_completion[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert streamed[-1].choices[0].stop_reason == completion_stop
    assert chat.choices[0].message.content == full_chat[: full_chat.find(chat_stop)]
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].stop_reason == chat_stop


def test_stop_regex_ends_the_text_at_its_first_match_through_the_openai_client(
    client, model, offline
):
    # SGLang's stop_regex, sent as the official client sends any extension (extra_body): the
    # middle word's first two characters after a space, escaped for RE2 as for `re`.
    full = offline["completions"][1].outputs[0].text
    word = _stop_string_in(full)
    pattern = re.escape(word[:3])  # " " and two characters: a bounded match
    expected = full[: re.search(pattern, full).start()]

    def complete(stop_regex: Any = (pattern,), **extra: Any) -> Any:
        return client.completions.create(
            model=model,
            prompt=COMPLETION_PROMPTS[1],
            temperature=0,
            max_tokens=NUM_GREEDY_TOKENS,
            extra_body={"stop_regex": list(stop_regex)},
            **extra,
        )

    plain, streamed = _in_parallel(complete, lambda: list(complete(stream=True)))
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].stop_reason == pattern
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected  # nothing leaked
    with pytest.raises(openai.BadRequestError, match="stop_regex"):
        complete(stop_regex=[r"(\w)\1"])  # a backreference: RE2 has none


def test_chat_continues_a_prefilled_assistant_message(client, model, offline, server):
    """vLLM's continue_final_message: the assistant's last message is left open in the real
    template, so greedy decoding picks up where the offline chat's first tokens left off."""
    (output,) = offline["chats"][0].outputs
    num_prefilled = 4
    prefill = httpx.post(
        f"{server[0]}/detokenize",
        json={"tokens": list(output.token_ids[:num_prefilled])},
        headers=AUTH,
        timeout=REQUEST_TIMEOUT_S,
    ).json()["prompt"]
    assert output.text.startswith(prefill) and prefill
    messages = [*CONVERSATIONS[0], {"role": "assistant", "content": prefill}]
    continued, with_variables = _in_parallel(
        lambda: client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=NUM_GREEDY_TOKENS - num_prefilled,
            extra_body={"add_generation_prompt": False, "continue_final_message": True},
        ),
        lambda: client.chat.completions.create(
            model=model,
            messages=CONVERSATIONS[0],
            temperature=0,
            max_tokens=NUM_GREEDY_TOKENS,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        ),
    )
    assert prefill + continued.choices[0].message.content == output.text
    assert with_variables.choices[0].message.content == output.text  # SmolLM2's ignores it
    for variables in ({"messages": []}, {"conversations": []}, {"sanitize_control_tokens": True}):
        refused = httpx.post(
            f"{server[0]}/v1/chat/completions",
            json={"messages": CONVERSATIONS[0], "chat_template_kwargs": variables},
            headers=AUTH,
            timeout=REQUEST_TIMEOUT_S,
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "chat_template_kwargs"


def test_bad_words_keep_a_greedy_answer_from_its_likeliest_word(client, model, offline):
    expected = offline["completions"][0].outputs[0].text  # "The capital of France is" ...
    word = expected.split()[0]
    assert expected.startswith(" " + word)
    response = client.completions.create(
        model=model,
        prompt=COMPLETION_PROMPTS[0],
        max_tokens=NUM_GREEDY_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"bad_words": [word]},
    )
    choice = response.choices[0]
    assert choice.text != expected
    # Banned: the word's tokens as written and after a space (here one token each).
    assert " " + word not in choice.logprobs.tokens and word not in choice.logprobs.tokens


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client, model):
    prompt = "A prefix cache test: " + " ".join(f"item {i}," for i in range(20))
    first, second = (
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        for _ in range(2)
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks
    forked = client.completions.create(  # n = 2 on a cold prompt: its choices share blocks,
        model=model,
        prompt="Cold: " + prompt,
        max_tokens=2,
        n=2,
        temperature=0,  # no cache hit
    )
    assert forked.usage.prompt_tokens_details.cached_tokens == 0


# --- logprobs and seeds ---------------------------------------------------------------------------


def test_completion_logprobs_are_legacy_lists_with_top_logprobs(client, model):
    response = client.completions.create(
        model=model, prompt=COMPLETION_PROMPTS[0], max_tokens=6, temperature=0, logprobs=12
    )  # above OpenAI's 5, as vLLM allows
    choice = response.choices[0]
    logprobs = choice.logprobs
    num_tokens = response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_tokens
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == num_tokens
    assert "".join(logprobs.tokens) == choice.text
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0 and 10 <= len(top) <= 13  # alternatives that decode alike merge
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the best token


def test_chat_logprobs_list_each_token_with_its_top_logprobs(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=CONVERSATIONS[0],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_return_token_ids_are_the_offline_llm_s_prompt_and_output_tokens(client, model, offline):
    response = client.completions.create(
        model=model,
        prompt=COMPLETION_PROMPTS[0],
        max_tokens=NUM_GREEDY_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (choice,) = response.choices
    expected = offline["completions"][0]
    assert choice.prompt_token_ids == expected.prompt_token_ids
    assert choice.token_ids == expected.outputs[0].token_ids
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=CONVERSATIONS[0],
            max_tokens=NUM_GREEDY_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    expected = offline["chats"][0]
    assert chunks[0].prompt_token_ids == expected.prompt_token_ids
    streamed = [token for chunk in chunks[1:] for token in chunk.choices[0].token_ids]
    assert streamed == expected.outputs[0].token_ids


def _reference_beams(prompt_ids: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """Beam search written out over Hugging Face's model (whole forward passes, no cache): each
    step, every live beam's 2 x width best next tokens; EOS ends a beam; the width best by
    cumulative logprob go on; at the end, ranked by cumulative logprob over the length with the
    prompt (vLLM's score at length_penalty 1); an ended beam's EOS is not returned."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.configs.engine import DEFAULT_MODEL
    from pagedserve.engine.model_loader import resolve_model_path

    path, _ = resolve_model_path(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    live, finished = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, total in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), dim=-1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                target = finished if token in eos else candidates
                target.append((tokens + [token], total + logprob))
        candidates.sort(key=lambda beam: beam[1], reverse=True)
        # The cut must not fall on a near tie, or float noise could pick either side.
        if len(candidates) > width:
            assert candidates[width - 1][1] - candidates[width][1] > 1e-3
        live = candidates[:width]

    def score(beam: tuple[list[int], float]) -> float:
        tokens, total = beam
        return total / (len(prompt_ids) + len(tokens) - (tokens[-1] in eos))

    best = sorted(finished + live, key=score, reverse=True)[:width]
    return [tokens[:-1] if tokens[-1] in eos else tokens for tokens, _ in best]


def test_beam_search_returns_the_beams_of_a_search_over_the_hf_model(client, model, offline):
    response = client.completions.create(
        model=model,
        prompt=COMPLETION_PROMPTS[0],
        max_tokens=6,
        n=3,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )
    beams = [choice.token_ids for choice in response.choices]
    prompt_ids = offline["completions"][0].prompt_token_ids
    assert beams == _reference_beams(prompt_ids, width=3, max_tokens=6)
    assert response.usage.completion_tokens == sum(len(beam) for beam in beams)


def test_chat_without_logprobs_returns_none(client, model):
    response = client.chat.completions.create(
        model=model, messages=CONVERSATIONS[0], max_tokens=2, temperature=0
    )
    assert response.choices[0].logprobs is None


def test_same_seed_gives_the_same_text_at_temperature_1(client, model):
    def complete(seed: int) -> list[str]:
        response = client.completions.create(
            model=model, prompt="Once upon a time", n=2, temperature=1, seed=seed, max_tokens=12
        )
        return [choice.text for choice in response.choices]

    def chat(seed: int) -> str:
        return (
            client.chat.completions.create(
                model=model, messages=CONVERSATIONS[0], temperature=1, seed=seed, max_tokens=12
            )
            .choices[0]
            .message.content
        )

    first, again, chat_first, chat_again = _in_parallel(
        lambda: complete(7), lambda: complete(7), lambda: chat(11), lambda: chat(11)
    )
    assert first == again
    assert first[0] != first[1]  # n=2 choices are different samples, not copies
    assert chat_first == chat_again


# --- bad requests ---------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 100)

# (id, path, body: dict or raw bytes, headers, status, param, code); param/code None = not checked.
BAD_REQUESTS = [
    ("malformed_json", COMPLETIONS, b'{"prompt": "x",', AUTH, 400, None, None),
    ("malformed_json_chat", CHAT, b"{not json}", AUTH, 400, None, None),
    ("body_not_an_object", COMPLETIONS, b"[1, 2]", AUTH, 400, None, None),
    ("missing_prompt", COMPLETIONS, {"max_tokens": 2}, AUTH, 400, "prompt", None),
    ("prompt_wrong_type", COMPLETIONS, {"prompt": 5}, AUTH, 400, "prompt", None),
    (
        "max_tokens_string",
        COMPLETIONS,
        {"prompt": "x", "max_tokens": "5"},
        AUTH,
        400,
        "max_tokens",
        None,
    ),
    (
        "temperature_string",
        CHAT,
        {"messages": USER, "temperature": "hot"},
        AUTH,
        400,
        "temperature",
        None,
    ),
    ("stream_not_bool", COMPLETIONS, {"prompt": "x", "stream": "yes"}, AUTH, 400, "stream", None),
    ("messages_not_a_list", CHAT, {"messages": "Hi"}, AUTH, 400, "messages", None),
    (
        "max_tokens_zero",
        COMPLETIONS,
        {"prompt": "x", "max_tokens": 0},
        AUTH,
        400,
        "max_tokens",
        None,
    ),
    (
        "max_tokens_negative",
        CHAT,
        {"messages": USER, "max_tokens": -1},
        AUTH,
        400,
        "max_tokens",
        None,
    ),
    (
        "max_tokens_beyond_context",
        COMPLETIONS,
        {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
        AUTH,
        400,
        "max_tokens",
        None,
    ),
    (
        "max_tokens_beyond_context_chat",
        CHAT,
        {"messages": USER, "max_tokens": 2 * MAX_MODEL_LEN},
        AUTH,
        400,
        "max_tokens",
        None,
    ),
    (
        "max_completion_tokens_beyond_context",
        CHAT,
        {"messages": USER, "max_completion_tokens": 2 * MAX_MODEL_LEN},
        AUTH,
        400,
        None,
        None,
    ),
    (
        "temperature_negative",
        COMPLETIONS,
        {"prompt": "x", "temperature": -0.5},
        AUTH,
        400,
        "temperature",
        None,
    ),
    (
        "temperature_negative_chat",
        CHAT,
        {"messages": USER, "temperature": -1},
        AUTH,
        400,
        "temperature",
        None,
    ),
    ("top_p_zero", COMPLETIONS, {"prompt": "x", "top_p": 0}, AUTH, 400, "top_p", None),
    ("top_p_above_one", CHAT, {"messages": USER, "top_p": 1.5}, AUTH, 400, "top_p", None),
    ("n_zero", COMPLETIONS, {"prompt": "x", "n": 0}, AUTH, 400, "n", None),
    ("n_negative_chat", CHAT, {"messages": USER, "n": -1}, AUTH, 400, "n", None),
    ("empty_messages", CHAT, {"messages": []}, AUTH, 400, "messages", None),
    (
        "unknown_role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "Hi"}]},
        AUTH,
        400,
        "messages[0].role",
        None,
    ),
    (
        "unknown_model",
        COMPLETIONS,
        {"prompt": "x", "model": "gpt-4"},
        AUTH,
        404,
        "model",
        "model_not_found",
    ),
    (
        "unknown_model_chat",
        CHAT,
        {"messages": USER, "model": "gpt-4"},
        AUTH,
        404,
        "model",
        "model_not_found",
    ),
    ("prompt_too_long", COMPLETIONS, {"prompt": LONG_PROMPT}, AUTH, 400, "prompt", None),
    (
        "prompt_too_long_chat",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        AUTH,
        400,
        "messages",
        None,
    ),
    ("empty_prompt", COMPLETIONS, {"prompt": ""}, AUTH, 400, "prompt", None),
    ("token_id_out_of_vocabulary", COMPLETIONS, {"prompt": [1, 10**9]}, AUTH, 400, "prompt", None),
    (
        "logprobs_above_20",
        COMPLETIONS,
        {"prompt": "x", "logprobs": 21},
        AUTH,
        400,
        "logprobs",
        None,
    ),
    (
        "top_logprobs_above_20",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        AUTH,
        400,
        "top_logprobs",
        None,
    ),
    (
        "top_logprobs_without_logprobs",
        CHAT,
        {"messages": USER, "top_logprobs": 2},
        AUTH,
        400,
        "top_logprobs",
        None,
    ),
    ("missing_api_key", COMPLETIONS, {"prompt": "x"}, {}, 401, None, "invalid_api_key"),
    (
        "wrong_api_key",
        CHAT,
        {"messages": USER},
        {"authorization": "Bearer nope"},
        401,
        None,
        "invalid_api_key",
    ),
    (
        "api_key_without_bearer",
        COMPLETIONS,
        {"prompt": "x"},
        {"authorization": API_KEY},
        401,
        None,
        "invalid_api_key",
    ),
    ("unknown_route", "/v1/engines", {"prompt": "x"}, AUTH, 404, None, None),
    (
        "body_too_large",
        COMPLETIONS,
        {"prompt": "x" * (1 << 20)},
        AUTH,
        413,
        None,
        "request_too_large",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_gets_its_4xx_with_an_openai_error_body_and_the_server_keeps_serving(
    server, path, body, headers, status, param, code
):
    url = server[0]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        url + path,
        content=content,
        timeout=REQUEST_TIMEOUT_S,
        headers={**headers, "content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert httpx.get(f"{url}/health", timeout=REQUEST_TIMEOUT_S).status_code == 200


def test_good_request_succeeds_after_the_bad_ones(client, model):
    response = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 2


def test_openai_client_raises_its_typed_exceptions(client, model, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    bad_key = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


# --- shutdown: keep last, it stops the module's server --------------------------------------------


def test_sigterm_ends_open_streams_and_exits_zero(server):
    url, process = server
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=REQUEST_TIMEOUT_S
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert process.wait(timeout=60) == 0
