"""vLLM's serve flags that its deployment scripts pass, and what each does here: a Unix socket,
uvicorn's log level and access log, the docs pages, and the parallelism sizes (1 only)."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from pagedserve.server.app import create_app
from pagedserve.server.cli import (
    GracefulServer,
    build_parser,
    config_from_args,
    main,
    uvicorn_config,
)
from tests.server.conftest import make_config, sse_json

USER = [{"role": "user", "content": "hi"}]


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]), environ={})


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        ([], "uvicorn_access_log", True),
        (["--disable-uvicorn-access-log"], "uvicorn_access_log", False),
        ([], "fastapi_docs", True),
        (["--disable-fastapi-docs"], "fastapi_docs", False),
        (["--disable-log-stats"], "log_stats", False),
        (["--uvicorn-log-level", "warning"], "uvicorn_log_level", "warning"),
        (["--uds", "/tmp/x.sock"], "uds", "/tmp/x.sock"),
    ],
)
def test_vllms_server_flags_set_the_server_config(flags, field, value):
    assert getattr(_config(*flags).server, field) == value


@pytest.mark.parametrize(
    ("flags", "enabled"),
    [([], True), (["--enable-chunked-prefill"], True), (["--no-enable-chunked-prefill"], False)],
)
def test_vllms_chunked_prefill_flags(flags, enabled):
    assert _config(*flags).scheduler.enable_chunked_prefill is enabled


@pytest.mark.parametrize(
    "flags", [["-tp", "1"], ["--tensor-parallel-size", "1"], ["-pp", "1", "-dp", "1"]]
)
def test_parallel_sizes_of_one_and_enforce_eager_are_accepted(flags):
    model = _config(*flags, "--enforce-eager").model
    assert (model.tensor_parallel_size, model.pipeline_parallel_size) == (1, 1)
    assert model.data_parallel_size == 1 and model.enforce_eager


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("-tp", "tensor_parallel_size"),
        ("-pp", "pipeline_parallel_size"),
        ("-dp", "data_parallel_size"),
    ],
)
def test_a_parallel_size_above_one_is_a_usage_error_pointing_at_replicas(capsys, flag, field):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", flag, "2"])
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{field} must be 1" in last_line and "pagedserve replicas N" in last_line


def test_replicas_refuse_a_unix_socket(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["replicas", "-n", "2", "--uds", "/tmp/x.sock"])
    assert exit_info.value.code == 2
    assert "--uds: replicas listen on ports of their own" in capsys.readouterr().err


def test_uvicorn_gets_the_socket_log_level_and_access_log():
    config = make_config(uds="/tmp/x.sock", uvicorn_log_level="trace", uvicorn_access_log=False)
    settings = uvicorn_config(object(), config, grace_s=1.0)
    assert (settings.uds, settings.log_level, settings.access_log) == (
        "/tmp/x.sock",
        "trace",
        False,
    )
    default = uvicorn_config(object(), make_config(log_level="warning"), grace_s=1.0)
    assert (default.uds, default.log_level, default.access_log) == (None, "warning", True)


@pytest.mark.parametrize("docs", [True, False])
def test_the_docs_pages_are_served_unless_turned_off(client_with, docs):
    client = client_with(fastapi_docs=docs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of duplicate operation ids as it builds
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert client.get(path).status_code == (200 if docs else 404)
    assert client.get("/v1/models").status_code == 200
    if docs:
        operations = [
            operation["operationId"]
            for methods in client.get("/openapi.json").json()["paths"].values()
            for operation in methods.values()
        ]
        assert len(operations) == len(set(operations))


def test_the_engine_state_is_served_by_default_on_a_unix_socket():
    assert make_config(host="0.0.0.0", uds="/tmp/x.sock").server.engine_state_enabled
    assert not make_config(host="0.0.0.0").server.engine_state_enabled


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("access_log", [True, False])
def test_the_openai_client_talks_over_the_unix_socket(engine, tmp_path, access_log):
    socket_path = tmp_path / "pagedserve.sock"
    config = make_config(uds=str(socket_path), uvicorn_access_log=access_log)
    settings = uvicorn_config(create_app(config, engine), config, 1.0)  # configures its loggers
    # uvicorn writes access lines only where its access logger has a handler; it has none when
    # turned off. When on, one more collects them (the logger does not propagate to pytest's).
    assert logging.getLogger("uvicorn.access").hasHandlers() is access_log
    access = _Lines()
    if access_log:
        logging.getLogger("uvicorn.access").addHandler(access)
    server = GracefulServer(settings, 0.2)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_started(server, socket_path)
        transport = httpx.HTTPTransport(uds=str(socket_path))
        client = openai.OpenAI(
            base_url="http://localhost/v1",
            api_key="none",
            http_client=httpx.Client(transport=transport),
        )
        reply = client.chat.completions.create(model=engine.model_name, messages=USER)
        assert reply.choices[0].message.content
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        logging.getLogger("uvicorn.access").removeHandler(access)
    assert any("POST /v1/chat/completions" in line for line in access.lines) is access_log


def _wait_started(server: GracefulServer, socket_path: Path) -> None:
    deadline = time.monotonic() + 10
    while not (server.started and socket_path.exists()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started and socket_path.exists()


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        ("/v1/completions", "logprobs", {"prompt": "hi"}),
        ("/v1/completions", "prompt_logprobs", {"prompt": "hi"}),
        ("/v1/chat/completions", "top_logprobs", {"messages": USER, "logprobs": True}),
        ("/v1/chat/completions", "prompt_logprobs", {"messages": USER}),
        ("/generate", "top_logprobs_num", {"text": "hi", "return_logprob": True}),
    ],
)
def test_max_logprobs_sets_the_cap_each_route_names_its_own_field_against(
    client_with, path, field, body
):
    client = client_with(max_logprobs=30)
    assert client.post(path, json={**body, field: 30}).status_code == 200
    refused = client.post(path, json={**body, field: 31})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == field and "(30, --max-logprobs)" in error["message"]
    assert client_with(max_logprobs=-1).post(path, json={**body, field: 500}).status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "engine_field", "body"),
    [
        ("/v1/completions", "logprobs", "logprobs", {"prompt": "hi"}),
        ("/v1/completions", "prompt_logprobs", "prompt_logprobs", {"prompt": "hi"}),
        ("/v1/chat/completions", "top_logprobs", "logprobs", {"messages": USER, "logprobs": True}),
        ("/v1/chat/completions", "prompt_logprobs", "prompt_logprobs", {"messages": USER}),
        (
            "/v1/responses",
            "top_logprobs",
            "logprobs",
            {"input": "hi", "include": ["message.output_text.logprobs"]},
        ),
    ],
)
def test_minus_one_asks_for_the_whole_vocabulary_where_max_logprobs_allows_it(
    client_with, engine, path, field, engine_field, body
):
    answered = client_with(max_logprobs=-1).post(path, json={**body, field: -1})
    assert answered.status_code == 200, answered.text
    assert getattr(engine.requests[-1][2], engine_field) == engine.vocab_size  # vLLM's meaning
    refused = client_with(max_logprobs=20).post(path, json={**body, field: -1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    assert f"{engine.vocab_size} alternatives" in refused.json()["error"]["message"]
    below = client_with(max_logprobs=-1).post(path, json={**body, field: -2})
    assert below.status_code == 400 and field in str(below.json()["error"]["param"])


def test_chats_own_logprobs_checks_come_before_the_cap(client_with):
    client = client_with(max_logprobs=20)  # -1 is over it, but these say what else is wrong
    unasked = client.post("/v1/chat/completions", json={"messages": USER, "top_logprobs": -1})
    assert "requires logprobs to be true" in unasked.json()["error"]["message"]
    body = {"messages": USER, "stream": True, "prompt_logprobs": -1}
    streamed = client.post("/v1/chat/completions", json=body)
    assert "not available when streaming" in streamed.json()["error"]["message"]


def test_top_logprobs_0_without_logprobs_is_accepted_as_asking_for_nothing(client, engine):
    # vLLM accepts it (a client's default of 0): no alternatives of no logprobs; 1 is refused.
    body = {"messages": USER, "top_logprobs": 0, "max_tokens": 2}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert engine.requests[-1][2].logprobs is None
    answer = client.post("/v1/chat/completions", json={**body, "top_logprobs": 1})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
)
def test_prompt_logprobs_0_in_a_stream_is_a_400_not_a_silent_drop(client, path, body):
    # 0 still asks for each prompt token's own logprob, which a stream does not carry: vLLM
    # accepts it and computes them for nothing; here it is refused, as any other count.
    body = {**body, "stream": True, "prompt_logprobs": 0, "max_tokens": 2}
    answer = client.post(path, json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_beam_search_wider_than_max_logprobs_allows_names_n(client_with, path):
    # Each beam step scores 2 x n candidates: n=3 needs 6 alternatives per token.
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": USER}
    body |= {"use_beam_search": True, "n": 3, "max_tokens": 2}
    refused = client_with(max_logprobs=5).post(path, json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "n"
    assert "needs 6 alternatives per token" in refused.json()["error"]["message"]
    assert client_with(max_logprobs=6).post(path, json=body).status_code == 200


def test_default_chat_template_kwargs_reach_the_template_under_the_request_s_own(client_with):
    client = client_with(default_chat_template_kwargs='{"enable_thinking": false, "style": "a"}')
    rendered = client.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert bytes(rendered).decode().startswith("[enable_thinking=False][style=a]<user>hi")
    body = {"messages": USER, "chat_template_kwargs": {"style": "b"}}
    rendered = client.post("/tokenize", json=body).json()["tokens"]
    assert bytes(rendered).decode().startswith("[enable_thinking=False][style=b]<user>hi")
    reply = client.post("/v1/chat/completions", json={**body, "return_prompt_text": True})
    assert reply.json()["prompt_text"].startswith("[enable_thinking=False][style=b]")
    # A request's null or "auto" leaves the server's value (vLLM's merge).
    unset = {"messages": USER, "chat_template_kwargs": {"enable_thinking": None, "style": "auto"}}
    rendered = client.post("/tokenize", json=unset).json()["tokens"]
    assert bytes(rendered).decode().startswith("[enable_thinking=False][style=a]<user>hi")


def test_default_chat_template_kwargs_naming_how_it_is_applied_fail_before_the_model_loads(
    capsys,
):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--default-chat-template-kwargs", '{"add_generation_prompt": false}'])
    assert exit_info.value.code == 2
    assert "may not set add_generation_prompt" in capsys.readouterr().err


def test_default_chat_template_kwargs_naming_how_the_template_is_applied_stop_the_start(engine):
    config = make_config(default_chat_template_kwargs='{"messages": [], "tokenize": true}')
    with (
        pytest.raises(ValueError, match="may not set messages, tokenize"),
        TestClient(create_app(config, engine)),
    ):
        pass


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hi"})],
)
def test_force_include_usage_ends_every_stream_with_usage(client_with, path, body, forced):
    client = client_with(enable_force_include_usage=forced)
    chunks = sse_json(client.post(path, json={**body, "stream": True, "max_tokens": 3}).text)
    assert (chunks[-1].get("usage") is not None) is forced
    if forced:  # as vLLM's: on every chunk with a token, and in a last chunk of its own
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        with_tokens = [c for c in chunks[:-1] if c["choices"] and _has_text(c["choices"][0])]
        assert with_tokens and all(c.get("usage") for c in with_tokens)
    # Forced, a request's own options do not turn it off; a whole reply has usage either way.
    off = {**body, "stream": True, "stream_options": {"include_usage": False}}
    assert (sse_json(client.post(path, json=off).text)[-1].get("usage") is not None) is forced
    assert client.post(path, json=body).json()["usage"]["total_tokens"] > 0


def _has_text(choice: dict) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


@pytest.mark.parametrize("asked", [None, True, False])
@pytest.mark.parametrize("server_default", [False, True])
def test_return_tokens_as_token_ids_defaults_to_the_server_s_setting(
    client_with, asked, server_default
):
    client = client_with(return_tokens_as_token_ids=server_default)
    as_ids = server_default if asked is None else asked
    field = {} if asked is None else {"return_tokens_as_token_ids": asked}
    body = {"prompt": "ab", "max_tokens": 1, "logprobs": 1, **field}
    (token,) = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert token == (f"token_id:{ord('a')}" if as_ids else "a")
    body = {"messages": USER, "max_tokens": 1, "logprobs": True, **field}
    (entry,) = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"][
        "content"
    ]
    assert entry["token"] == (f"token_id:{ord('a')}" if as_ids else "a")
