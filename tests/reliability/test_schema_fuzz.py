"""Property-based fuzzing of the real server against its own OpenAPI schema (schemathesis, both
schema-valid and schema-violating bodies): never a 5xx, every error an OpenAI error body, every
success well-formed, and the KV pool idle afterwards. Bounded by `PAGEDSERVE_FUZZ_SECONDS`."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.reliability.support import (
    AUTH,
    assert_no_stack_trace,
    assert_openai_error,
    parse_sse,
    wait_for_idle_pool,
)

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.core import NotSet  # noqa: E402

FUZZ_SECONDS = float(os.environ.get("PAGEDSERVE_FUZZ_SECONDS", "30"))
MAX_EXAMPLES = 5000  # the time budget, not this, is what normally ends the run
MAX_GENERATED_TOKENS = 2  # keeps each accepted request to a couple of decode steps on a CPU
MAX_PROMPTS = 3
SCORING_PATHS = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
GENERATION_PATHS = (
    *("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"),
    *("/generate", *SCORING_PATHS),
)
MAX_TOKEN_FIELDS = {
    "/v1/responses": ("max_output_tokens",),
    "/v1/embeddings": (),  # one token each
    "/generate": (),  # inside sampling_params (_cheap_sampling)
} | {path: () for path in SCORING_PATHS}
TEXT_LISTS = ("input", "documents", "text_1", "text_2", "queries", "items", "data_1", "data_2")
TEXT_LISTS += ("text", "input_ids")  # SGLang's batches


class _TimeIsUp(BaseException):
    """Raised from inside the property to end Hypothesis' run (it only catches Exception)."""


def _keep_it_cheap(path: str, body: Any) -> Any:
    """Clamp the cost of bodies the engine would run (how many tokens, prompts and choices);
    everything else, wrong types included, is sent exactly as generated."""
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return body
    body = dict(body)
    names = MAX_TOKEN_FIELDS.get(path, ("max_tokens", "max_completion_tokens"))
    for name in names:
        value = body.get(name)
        if value is None or (type(value) is int and value > MAX_GENERATED_TOKENS):
            body[name] = MAX_GENERATED_TOKENS  # absent means "the whole context" for chat
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2
    if type(body.get("best_of")) is int and body["best_of"] > 2:
        body["best_of"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:MAX_PROMPTS]
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:4]
    for name in TEXT_LISTS:
        if isinstance(body.get(name), list) and body[name] and not isinstance(body[name][0], int):
            body[name] = body[name][:4]
    if path == "/generate":
        body["sampling_params"] = _cheap_sampling(body.get("sampling_params"))
    return body


def _cheap_sampling(sampling: Any) -> Any:
    """SGLang's sampling_params (absent or null: 128 tokens) at most MAX_GENERATED_TOKENS long."""
    if isinstance(sampling, list):
        return [_cheap_sampling(entry) for entry in sampling]
    if sampling is None:
        return {"max_new_tokens": MAX_GENERATED_TOKENS}
    if not isinstance(sampling, dict):
        return sampling
    sampling = dict(sampling)
    value = sampling.get("max_new_tokens")
    if value is None or (type(value) is int and value > MAX_GENERATED_TOKENS):
        sampling["max_new_tokens"] = MAX_GENERATED_TOKENS
    if type(sampling.get("n")) is int and sampling["n"] > 2:
        sampling["n"] = 2
    return sampling


def _check_success(response: httpx.Response) -> None:
    assert_no_stack_trace(response.text)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        if response.request.url.path == "/v1/responses":  # typed events, no [DONE] (OpenAI's)
            data = [line for line in response.text.splitlines() if line.startswith("data: ")]
            last = json.loads(data[-1].removeprefix("data: "))
            assert last["type"] in ("response.completed", "response.incomplete"), last
            return
        events, done = parse_sse(response.text.splitlines())
        assert done, response.text[-500:]
        assert not [event for event in events if "error" in event], response.text[-1000:]
    elif response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        for choice in body.get("choices", []) if isinstance(body, dict) else []:
            assert choice["finish_reason"] in ("stop", "length"), body


def test_fuzzing_the_openapi_schema_never_gives_a_5xx_or_a_malformed_error(
    http, server, shared_server
):
    schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    strategy = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    deadline = time.monotonic() + FUZZ_SECONDS
    sent: dict[str, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def send_one(case: Any) -> None:
        if time.monotonic() > deadline:
            raise _TimeIsUp
        body = None if isinstance(case.body, NotSet) else _keep_it_cheap(case.path, case.body)
        if body is None or isinstance(body, bytes):
            content = body
        else:
            content = json.dumps(body, allow_nan=True).encode()
        headers = {**{k: str(v) for k, v in (case.headers or {}).items()}, **AUTH}
        if content is not None:
            headers["Content-Type"] = case.media_type or "application/json"
        response = http.request(
            case.method,
            case.formatted_path,
            content=content,
            headers=headers,
            params=case.query or None,
            timeout=60,
        )
        key = f"{case.method} {case.path} {response.status_code}"
        sent[key] = sent.get(key, 0) + 1
        if response.status_code >= 400:
            assert_openai_error(response.status_code, response.text)
        else:
            _check_success(response)

    with contextlib.suppress(_TimeIsUp):
        send_one()
    print(f"\nFIGURE fuzzed requests: {sum(sent.values())} ({json.dumps(sent, sort_keys=True)})")
    assert sum(sent.values()) >= 20, sent
    samples = wait_for_idle_pool(server.url, shared_server.idle_free_blocks)
    assert samples["pagedserve:num_free_blocks"] == shared_server.idle_free_blocks
