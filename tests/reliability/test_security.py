"""Security basics: the API key (constant-time comparison, 401 everywhere but the probes), body
and prompt limits, `trust_remote_code` off unless asked for, and no stack trace in any response."""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedserve.configs import load_engine_config
from pagedserve.configs.engine import ModelConfig
from pagedserve.server import middleware
from pagedserve.server.cli import build_parser, config_from_args
from tests.reliability.support import API_KEY, assert_no_stack_trace, assert_openai_error

PROTECTED = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/v1/engine/state"),
    ("GET", "/openapi.json"),
    ("GET", "/no/such/path"),
]
BAD_CREDENTIALS = {
    "missing": {},
    "wrong_key": {"Authorization": "Bearer not-the-key"},
    "key_prefix": {"Authorization": f"Bearer {API_KEY[:-1]}"},
    "key_with_suffix": {"Authorization": f"Bearer {API_KEY}x"},
    "no_scheme": {"Authorization": API_KEY},
    "basic_scheme": {"Authorization": f"Basic {API_KEY}"},
    "empty_bearer": {"Authorization": "Bearer"},
    "lowercase_scheme": {"Authorization": f"bearer {API_KEY}"},
}


def test_the_api_key_is_compared_in_constant_time():
    source = inspect.getsource(middleware.ApiKeyMiddleware)
    assert "hmac.compare_digest(" in source
    assert "== self.expected" not in source and "self.expected ==" not in source


@pytest.mark.parametrize("credentials", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[path for _, path in PROTECTED])
def test_a_missing_or_wrong_api_key_gets_401(server, method, path, credentials):
    response = httpx.request(
        method,
        f"{server.url}{path}",
        headers=credentials,
        timeout=30,
        json={"prompt": "Hi", "max_tokens": 1} if method == "POST" else None,
    )
    error = assert_openai_error(response.status_code, response.text, {401})
    assert error["code"] == "invalid_api_key"
    assert API_KEY not in response.text


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_probes_and_scrapers_need_no_api_key(server, path):
    response = httpx.get(f"{server.url}{path}", timeout=30)
    assert response.status_code == 200, response.text


def test_an_unauthenticated_oversized_body_is_turned_away_before_it_is_read(server):
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b"x" * (4 << 20),
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert_openai_error(response.status_code, response.text, {401})


def test_a_body_over_the_limit_is_413_and_a_prompt_over_the_context_is_400(http):
    too_large = http.post(
        "/v1/completions",
        content=b" " * ((1 << 20) + 1),
        headers={"Content-Type": "application/json"},
    )
    assert (
        assert_openai_error(too_large.status_code, too_large.text, {413})["code"]
        == "request_too_large"
    )
    too_long = http.post("/v1/completions", json={"prompt": [42] * 1024, "max_tokens": 1})
    assert assert_openai_error(too_long.status_code, too_long.text, {400})["param"] == "prompt"


def test_an_unexpected_internal_error_shows_no_stack_trace(http):
    # A lone surrogate currently crashes the tokenizer (a 500, see test_bad_input): whatever the
    # status, the body must be an OpenAI error without any trace of the server's code.
    response = http.post(
        "/tokenize", content=b'{"prompt": "\\ud800"}', headers={"Content-Type": "application/json"}
    )
    assert_openai_error(response.status_code, response.text, set(range(400, 600)))
    assert "TypeError" not in response.text and "/work/" not in response.text


def test_trust_remote_code_is_off_unless_the_flag_is_given():
    assert load_engine_config(cli={}, environ={}).model.trust_remote_code is False
    assert (
        config_from_args(build_parser().parse_args(["serve"]), environ={}).model.trust_remote_code
        is False
    )
    assert (
        config_from_args(
            build_parser().parse_args(["serve", "--trust-remote-code"]), environ={}
        ).model.trust_remote_code
        is True
    )


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_load_model_passes_trust_remote_code_through_as_configured(monkeypatch, trust_remote_code):
    from pagedserve.engine import model_loader

    calls: list[tuple[str, dict[str, Any]]] = []

    class StubModel:
        config = types.SimpleNamespace(max_position_embeddings=2048)

        def to(self, device: Any) -> StubModel:
            return self

        def eval(self) -> StubModel:
            return self

        def parameters(self) -> Iterator[Any]:  # no weights: nothing for the loader to pack
            return iter(())

    def from_pretrained(kind: str, result: Any) -> Any:
        def load(path: Any, **kwargs: Any) -> Any:
            calls.append((kind, kwargs))
            return result

        return load

    monkeypatch.setattr(
        model_loader.AutoModelForCausalLM, "from_pretrained", from_pretrained("model", StubModel())
    )
    monkeypatch.setattr(
        model_loader.AutoTokenizer, "from_pretrained", from_pretrained("tokenizer", object())
    )
    model_loader.load_model(ModelConfig(trust_remote_code=trust_remote_code), "cpu")
    assert sorted(kind for kind, _ in calls) == ["model", "tokenizer"]
    for _, kwargs in calls:
        assert kwargs["trust_remote_code"] is trust_remote_code
        assert kwargs["local_files_only"] is True


def test_error_bodies_of_a_failed_auth_and_a_404_hold_no_stack_trace(server):
    for response in (
        httpx.get(f"{server.url}/v1/models", timeout=30),
        httpx.get(
            f"{server.url}/v1/models/x", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}
        ),
    ):
        assert_no_stack_trace(response.text)
        assert_openai_error(response.status_code, response.text)
