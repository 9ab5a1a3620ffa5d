"""A table of bad inputs sent as raw bytes to one real server: every one gets a 4xx OpenAI error
body (never a 500, a hang or a dropped connection, never a stack trace), the few documented as
accepted get a well-formed 200, and afterwards the server still completes correctly with its KV
pool back to idle."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.reliability.support import (
    assert_completion,
    assert_no_stack_trace,
    assert_openai_error,
    read_metrics,
    wait_for_idle_pool,
)

COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = (
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
)
JSON = {"Content-Type": "application/json"}
VOCAB_SIZE = 49152  # SmolLM2's
MAX_BODY_BYTES = 1 << 20  # the server's default limit
CLIENT_ERROR = frozenset(range(400, 500))
OK = frozenset({200})
USER = [{"role": "user", "content": "Hi"}]


Body = bytes | Callable[[], Iterator[bytes]]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Body | None
    statuses: frozenset[int] = CLIENT_ERROR
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    method: str = "POST"
    param: str | None = "-"  # "-": not checked
    marks: tuple[Any, ...] = ()


def j(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields: Any) -> bytes:
    return j(**{"prompt": "Hi", "max_tokens": 1, **fields})


def chat(**fields: Any) -> bytes:
    return j(**{"messages": USER, "max_tokens": 1, **fields})


def raw_completion(fragment: str) -> bytes:
    """A body with raw JSON text (NaN, 1e999...) that json.dumps would never write."""
    return ('{"prompt": "Hi", "max_tokens": 1, ' + fragment + "}").encode()


def nested_lists(depth: int) -> str:
    return "[" * depth + "]" * depth


def chunked(num_bytes: int) -> Callable[[], Iterator[bytes]]:
    """A body sent without Content-Length (chunked), so only the streaming check can stop it."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(num_bytes // 65536):
            yield b"a" * 65536
        yield b'", "max_tokens": 1}'

    return chunks


CASES: list[Case] = [
    # ---- malformed and truncated JSON, on every endpoint --------------------------------------
    *[
        Case(f"truncated_json_{name}", path, b'{"prompt": "Hi", "max_to')
        for name, path in (
            ("completions", COMPLETIONS),
            ("chat", CHAT),
            ("tokenize", TOKENIZE),
            ("detokenize", DETOKENIZE),
        )
    ],
    Case("empty_body", COMPLETIONS, b""),
    Case("empty_body_chat", CHAT, b""),
    Case("not_json", COMPLETIONS, b"hello there"),
    Case("trailing_garbage", COMPLETIONS, completion() + b" x"),
    Case("single_quotes", CHAT, b"{'messages': []}"),
    Case("body_is_array", COMPLETIONS, b'[{"prompt": "Hi"}]'),
    Case("body_is_string", CHAT, b'"Hi"'),
    Case("body_is_null", TOKENIZE, b"null"),
    Case("body_is_number", DETOKENIZE, b"42"),
    Case(
        "nested_lists_100k_as_prompt",
        COMPLETIONS,
        b'{"prompt": ' + nested_lists(100_000).encode() + b"}",
    ),
    Case("nested_lists_100k_as_body", CHAT, nested_lists(100_000).encode()),
    Case("nested_objects_50k", TOKENIZE, b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    Case("unterminated_string", DETOKENIZE, b'{"tokens": [1, 2], "model": "x'),
    # ---- wrong types and nulls ----------------------------------------------------------------
    Case("prompt_number", COMPLETIONS, j(prompt=123, max_tokens=1), param="prompt"),
    Case("prompt_null", COMPLETIONS, j(prompt=None, max_tokens=1), param="prompt"),
    Case("prompt_missing", COMPLETIONS, j(max_tokens=1), param="prompt"),
    Case("prompt_object", COMPLETIONS, j(prompt={"text": "Hi"}), param="prompt"),
    Case("prompt_floats", COMPLETIONS, j(prompt=[1.5, 2.0]), param="prompt"),
    Case("prompt_booleans", COMPLETIONS, j(prompt=[True, False]), param="prompt"),
    Case("prompt_mixed_list", COMPLETIONS, j(prompt=["Hi", 5]), param="prompt"),
    Case("max_tokens_string", COMPLETIONS, completion(max_tokens="5"), param="max_tokens"),
    Case("max_tokens_float", COMPLETIONS, completion(max_tokens=1.5), param="max_tokens"),
    Case("max_tokens_bool", CHAT, chat(max_tokens=True), param="max_tokens"),
    Case("temperature_string", COMPLETIONS, completion(temperature="hot"), param="temperature"),
    Case("stream_string", CHAT, chat(stream="yes"), param="stream"),
    Case("stop_number", COMPLETIONS, completion(stop=5), param="stop"),
    Case("stop_list_of_numbers", CHAT, chat(stop=[1, 2]), param="stop"),
    Case(
        "stream_options_string",
        COMPLETIONS,
        completion(stream=True, stream_options="x"),
        param="stream_options",
    ),
    Case("messages_string", CHAT, j(messages="Hi"), param="messages"),
    Case("messages_null", CHAT, j(messages=None), param="messages"),
    Case("messages_empty", CHAT, j(messages=[]), param="messages"),
    Case("message_unknown_role", CHAT, j(messages=[{"role": "robot", "content": "x"}])),
    Case("message_without_content", CHAT, j(messages=[{"role": "user"}])),
    Case("message_content_null", CHAT, j(messages=[{"role": "user", "content": None}])),
    Case(
        "message_image_part",
        CHAT,
        j(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
                    ],
                }
            ]
        ),
    ),
    Case("model_number", COMPLETIONS, completion(model=123), param="model"),
    Case("model_unknown", CHAT, chat(model="gpt-17"), statuses=frozenset({404}), param="model"),
    Case(
        "logit_bias_key_not_id", COMPLETIONS, completion(logit_bias={"abc": 1}), param="logit_bias"
    ),
    Case(
        "logit_bias_value_string",
        COMPLETIONS,
        completion(logit_bias={"1": "x"}),
        param="logit_bias",
    ),
    # ---- out-of-range and extreme numbers -----------------------------------------------------
    Case("max_tokens_1e12", COMPLETIONS, completion(max_tokens=10**12), param="max_tokens"),
    Case("max_tokens_beyond_int64", CHAT, chat(max_tokens=10**30), param="max_tokens"),
    Case("max_tokens_zero", COMPLETIONS, completion(max_tokens=0), param="max_tokens"),
    Case("max_tokens_negative", CHAT, chat(max_tokens=-1), param="max_tokens"),
    Case("max_completion_tokens_1e12", CHAT, chat(max_completion_tokens=10**12)),
    Case("temperature_nan", COMPLETIONS, raw_completion('"temperature": NaN'), param="temperature"),
    Case(
        "temperature_infinity",
        COMPLETIONS,
        raw_completion('"temperature": Infinity'),
        param="temperature",
    ),
    Case(
        "temperature_minus_infinity",
        COMPLETIONS,
        raw_completion('"temperature": -Infinity'),
        param="temperature",
    ),
    Case(
        "temperature_1e999",
        COMPLETIONS,
        raw_completion('"temperature": 1e999'),
        param="temperature",
    ),
    Case("temperature_negative", CHAT, chat(temperature=-0.5), param="temperature"),
    Case("temperature_too_high", CHAT, chat(temperature=1e6), param="temperature"),
    Case("top_p_zero", COMPLETIONS, completion(top_p=0), param="top_p"),
    Case("top_p_nan", COMPLETIONS, raw_completion('"top_p": NaN'), param="top_p"),
    Case("n_1e6", COMPLETIONS, completion(n=10**6), param="n"),
    Case("n_zero", CHAT, chat(n=0), param="n"),
    Case("top_k_negative", COMPLETIONS, completion(top_k=-5), param="top_k"),
    Case("min_p_above_one", CHAT, chat(min_p=2.0), param="min_p"),
    Case(
        "presence_penalty_out_of_range",
        COMPLETIONS,
        completion(presence_penalty=3),
        param="presence_penalty",
    ),
    Case(
        "frequency_penalty_1e999",
        COMPLETIONS,
        raw_completion('"frequency_penalty": 1e999'),
        param="frequency_penalty",
    ),
    Case("repetition_penalty_zero", CHAT, chat(repetition_penalty=0), param="repetition_penalty"),
    Case("logprobs_21", COMPLETIONS, completion(logprobs=21), param="logprobs"),
    Case("logprobs_negative", COMPLETIONS, completion(logprobs=-1), param="logprobs"),
    Case("top_logprobs_21", CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
    Case("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), param="top_logprobs"),
    Case("seed_negative", COMPLETIONS, completion(seed=-1), param="seed"),
    Case("seed_beyond_int64", COMPLETIONS, completion(seed=2**64), param="seed"),
    Case(
        "min_tokens_above_max_tokens",
        COMPLETIONS,
        completion(min_tokens=10**12),
        param="min_tokens",
    ),
    Case(
        "logit_bias_nan",
        COMPLETIONS,
        raw_completion('"logit_bias": {"1": NaN}'),
        param="logit_bias",
    ),
    Case("logit_bias_huge", CHAT, chat(logit_bias={"1": 1e300}), param="logit_bias"),
    Case("best_of_differs_from_n", COMPLETIONS, completion(best_of=3), param="best_of"),
    Case("suffix_unsupported", COMPLETIONS, completion(suffix="x"), param="suffix"),
    Case(
        "prompt_logprobs_21", COMPLETIONS, completion(prompt_logprobs=21), param="prompt_logprobs"
    ),
    Case(
        "prompt_logprobs_streamed",
        CHAT,
        chat(prompt_logprobs=1, stream=True),
        param="prompt_logprobs",
    ),
    Case("max_tokens_zero_without_echo", COMPLETIONS, completion(max_tokens=0), param="max_tokens"),
    Case("max_tokens_zero_in_chat", CHAT, chat(max_tokens=0), param="max_tokens"),
    # ---- huge stop lists ----------------------------------------------------------------------
    Case(
        "stop_list_10k",
        COMPLETIONS,
        completion(stop=[f"s{i}" for i in range(10_000)]),
        param="stop",
    ),
    Case("stop_string_10k_chars", CHAT, chat(stop=["x" * 10_000]), param="stop"),
    Case("stop_empty_string", COMPLETIONS, completion(stop=[""]), param="stop"),
    Case("stop_token_ids_negative", CHAT, chat(stop_token_ids=[-1]), param="stop_token_ids"),
    # ---- invalid UTF-8 and invalid Unicode ----------------------------------------------------
    Case("invalid_utf8_bytes", COMPLETIONS, b'{"prompt": "\xff\xfe\xc3", "max_tokens": 1}'),
    Case(
        "invalid_utf8_in_chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 1}',
    ),
    # ED A0 80 is a UTF-8-encoded surrogate: Python's json.loads (surrogatepass) lets it through.
    Case("utf8_encoded_surrogate_tokenize", TOKENIZE, b'{"prompt": "\xed\xa0\x80"}'),
    Case(
        "utf8_encoded_surrogate_completions",
        COMPLETIONS,
        b'{"prompt": "a\xed\xb0\x80", "max_tokens": 1}',
    ),
    # Python's json.loads detects UTF-16/32 by their BOM; such a body is served like UTF-8.
    Case("utf16_body_is_parsed", COMPLETIONS, completion().decode().encode("utf-16"), statuses=OK),
    Case("lone_surrogate_prompt", COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 1}'),
    Case(
        "lone_surrogate_chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
    ),
    Case("lone_surrogate_tokenize", TOKENIZE, b'{"prompt": "a\\ud800b"}'),
    # ---- oversized bodies and prompts ---------------------------------------------------------
    Case(
        "body_over_limit",
        COMPLETIONS,
        completion(prompt="a" * (MAX_BODY_BYTES + 1)),
        statuses=frozenset({413}),
    ),
    Case("chunked_body_over_limit", CHAT, chunked(2 * MAX_BODY_BYTES), statuses=frozenset({413})),
    Case(
        "prompt_longer_than_context",
        COMPLETIONS,
        completion(prompt="hello " * 3000),
        param="prompt",
    ),
    Case(
        "prompt_ids_longer_than_context",
        COMPLETIONS,
        completion(prompt=[42] * 2000),
        param="prompt",
    ),
    Case(
        "chat_longer_than_context",
        CHAT,
        chat(messages=[{"role": "user", "content": "hello " * 3000}]),
        param="messages",
    ),
    Case(
        "prompt_plus_max_tokens_over_context",
        COMPLETIONS,
        completion(prompt=[42] * 1000, max_tokens=100),
        param="max_tokens",
    ),
    # ---- empty and whitespace prompts ---------------------------------------------------------
    Case("prompt_empty_string", COMPLETIONS, completion(prompt=""), param="prompt"),
    Case("prompt_empty_list", COMPLETIONS, completion(prompt=[]), param="prompt"),
    Case(
        "prompt_list_with_empty_ids", COMPLETIONS, completion(prompt=[[1, 2], []]), param="prompt"
    ),
    Case(
        "prompt_list_with_empty_string", COMPLETIONS, completion(prompt=["Hi", ""]), param="prompt"
    ),
    # Whitespace is text like any other (OpenAI completes it): a well-formed 200.
    Case("prompt_whitespace_is_completed", COMPLETIONS, completion(prompt="  \n\t "), statuses=OK),
    Case(
        "tokenize_neither_prompt_nor_messages", TOKENIZE, j(add_special_tokens=True), param="prompt"
    ),
    Case("tokenize_prompt_and_messages", TOKENIZE, j(prompt="Hi", messages=USER), param="prompt"),
    Case("tokenize_prompt_number", TOKENIZE, j(prompt=5), param="prompt"),
    Case("tokenize_messages_empty", TOKENIZE, j(messages=[]), param="messages"),
    Case(
        "tokenize_add_special_tokens_string",
        TOKENIZE,
        j(prompt="Hi", add_special_tokens="y"),
        param="add_special_tokens",
    ),
    Case(
        "tokenize_unknown_model",
        TOKENIZE,
        j(prompt="Hi", model="nope"),
        statuses=frozenset({404}),
        param="model",
    ),
    # ---- token ids out of the vocabulary ------------------------------------------------------
    Case(
        "prompt_id_equal_to_vocab_size",
        COMPLETIONS,
        completion(prompt=[VOCAB_SIZE]),
        param="prompt",
    ),
    Case("prompt_id_negative", COMPLETIONS, completion(prompt=[-1]), param="prompt"),
    Case("prompt_id_beyond_int64", COMPLETIONS, completion(prompt=[2**64]), param="prompt"),
    Case(
        "batched_prompt_ids_one_out_of_vocab",
        COMPLETIONS,
        completion(prompt=[[1, 2], [3, 10**9]]),
        param="prompt",
    ),
    Case(
        "logit_bias_id_out_of_vocab",
        CHAT,
        chat(logit_bias={str(VOCAB_SIZE): 1}),
        param="logit_bias",
    ),
    Case(
        "stop_token_id_out_of_vocab_with_min_tokens",
        COMPLETIONS,
        completion(stop_token_ids=[VOCAB_SIZE], min_tokens=1),
        param="stop_token_ids",
    ),
    Case(
        "allowed_token_id_out_of_vocab",
        COMPLETIONS,
        completion(allowed_token_ids=[5, VOCAB_SIZE]),
        param="allowed_token_ids",
    ),
    Case("allowed_token_ids_empty", CHAT, chat(allowed_token_ids=[]), param="allowed_token_ids"),
    Case(
        "allowed_token_id_negative", CHAT, chat(allowed_token_ids=[-1]), param="allowed_token_ids"
    ),
    Case("allowed_token_ids_string", CHAT, chat(allowed_token_ids="5"), param="allowed_token_ids"),
    Case("detokenize_id_out_of_vocab", DETOKENIZE, j(tokens=[10**9]), param="tokens"),
    Case("detokenize_id_negative", DETOKENIZE, j(tokens=[-5]), param="tokens"),
    Case("detokenize_tokens_string", DETOKENIZE, j(tokens="abc"), param="tokens"),
    Case("detokenize_tokens_missing", DETOKENIZE, j(), param="tokens"),
    Case("detokenize_tokens_floats", DETOKENIZE, j(tokens=[1.5]), param="tokens"),
    # ---- unknown fields are ignored (documented in server/protocol.py) ------------------------
    Case(
        "unknown_fields_completions",
        COMPLETIONS,
        completion(frobnicate=True, tools=[1]),
        statuses=OK,
    ),
    Case("unknown_fields_chat", CHAT, chat(frobnicate={"a": 1}, x=None), statuses=OK),
    # response_format is acted on now (structured outputs): an unknown type is refused, not ignored
    Case("response_format_unknown_type", CHAT, chat(response_format={"type": "json"})),
    Case("unknown_fields_tokenize", TOKENIZE, j(prompt="Hi", extra={"a": 1}), statuses=OK),
    # ---- wrong content types and methods ------------------------------------------------------
    Case(
        "content_type_text_plain",
        COMPLETIONS,
        completion(),
        headers={"Content-Type": "text/plain"},
        statuses=frozenset({400, 415}),
    ),
    Case(
        "content_type_form",
        CHAT,
        b"messages=Hi",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        statuses=frozenset({400, 415}),
    ),
    Case(
        "content_type_multipart",
        TOKENIZE,
        b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nHi\r\n--b--\r\n',
        headers={"Content-Type": "multipart/form-data; boundary=b"},
        statuses=frozenset({400, 415}),
    ),
    Case(
        "content_type_xml",
        DETOKENIZE,
        b"<tokens>1</tokens>",
        headers={"Content-Type": "application/xml"},
        statuses=frozenset({400, 415}),
    ),
    # Documented in server/app.py: a JSON body without a Content-Type header is still parsed.
    Case("content_type_missing_is_parsed", COMPLETIONS, completion(), headers={}, statuses=OK),
    Case("get_on_completions", COMPLETIONS, None, method="GET", statuses=frozenset({405})),
    Case("delete_on_chat", CHAT, None, method="DELETE", statuses=frozenset({405})),
    Case(
        "unknown_path", "/v1/engines/davinci/completions", completion(), statuses=frozenset({404})
    ),
]


def _send(http: httpx.Client, case: Case) -> httpx.Response:
    content = case.body() if callable(case.body) else case.body
    return http.request(case.method, case.path, content=content, headers=case.headers, timeout=60)


def _check_success(path: str, body: dict[str, Any]) -> None:
    if path in (COMPLETIONS, CHAT):
        assert_completion(body)
    elif path == TOKENIZE:
        assert body["count"] == len(body["tokens"]) > 0, body


def test_the_corpus_has_at_least_sixty_cases_on_every_endpoint():
    assert len(CASES) >= 60
    assert len({case.name for case in CASES}) == len(CASES), "case names must be unique"
    assert {COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE} <= {case.path for case in CASES}
    print(f"\nFIGURE bad-input cases: {len(CASES)}")


@pytest.mark.parametrize(
    "case", [pytest.param(case, id=case.name, marks=case.marks) for case in CASES]
)
def test_bad_input_gets_an_openai_error_body_and_never_a_500(http, case):
    response = _send(http, case)
    if case.statuses == OK:
        assert response.status_code == 200, response.text[:500]
        assert_no_stack_trace(response.text)
        _check_success(case.path, response.json())
        return
    error = assert_openai_error(response.status_code, response.text, case.statuses)
    if case.param != "-":  # the field, or a part of it ('logit_bias.1', 'messages[0].role')
        assert error["param"] is not None and error["param"].startswith(case.param), error


def test_server_still_completes_correctly_with_the_pool_idle_after_the_corpus(
    http, server, shared_server
):
    response = http.post(
        COMPLETIONS, json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert_completion(body)
    assert "Paris" in body["choices"][0]["text"]
    chat_response = http.post(CHAT, json={"messages": USER, "max_tokens": 2, "temperature": 0})
    assert chat_response.status_code == 200, chat_response.text
    assert_completion(chat_response.json())

    samples = wait_for_idle_pool(server.url, shared_server.idle_free_blocks)
    assert samples["pagedserve:num_free_blocks"] == shared_server.idle_free_blocks
    assert (
        read_metrics(server.url)[
            'pagedserve:request_success_total{finished_reason="error",'
            'model_name="SmolLM2-135M-Instruct"}'
        ]
        == 0
    )
