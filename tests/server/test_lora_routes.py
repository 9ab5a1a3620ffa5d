"""LoRA adapters at the HTTP layer (fake engine): a request runs an adapter by naming it as its
model (vLLM's convention), /v1/models lists the adapters after the model, and any other name is
still a 404; with --allow-runtime-lora-updating, vLLM's routes load and unload adapters. The
engine's side (the adapters' terms, loads while serving) is tests/engine/test_lora.py's."""

from __future__ import annotations

import pytest

from pagedserve.engine.lora_adapter import LoRAError
from tests.server.conftest import FakeEngine

ADAPTERS = {"enable_lora": True, "lora_modules": ["sql=/adapters/sql", "chat=/adapters/chat"]}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def lora_client(client_with, engine: FakeEngine):
    engine.lora_adapters = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    return client_with(**ADAPTERS)


def test_the_models_list_has_each_adapter_after_the_model(lora_client, engine: FakeEngine):
    cards = lora_client.get("/v1/models").json()["data"]
    assert [card["id"] for card in cards] == [engine.model_name, "sql", "chat"]
    assert cards[1]["parent"] == engine.model_name and cards[1]["root"] == "/adapters/sql"
    assert cards[0]["parent"] is None
    assert lora_client.get("/v1/models/chat").json()["root"] == "/adapters/chat"
    assert lora_client.get("/v1/models/other").status_code == 404


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("model", ["sql", None])
def test_a_request_runs_the_adapter_it_names(lora_client, engine: FakeEngine, route, model):
    body = {"prompt": "hi"} if route == "completions" else {"messages": USER}
    body |= {"max_tokens": 2} | ({"model": model} if model else {})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    response = lora_client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert engine.requests[-1][2].lora == model
    assert response.json()["model"] == (model or engine.model_name)


def test_beam_search_steps_run_the_adapter(lora_client, engine: FakeEngine):
    body = {"prompt": "hi", "model": "chat", "max_tokens": 2, "n": 2, "use_beam_search": True}
    response = lora_client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert engine.requests and {params.lora for _, _, params in engine.requests} == {"chat"}


def test_an_unknown_model_is_a_404_and_so_is_an_adapter_not_served(client, lora_client, engine):
    for test_client in (client, lora_client):
        response = test_client.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
        assert response.status_code == 404
    engine.lora_adapters = {}  # what the engine serves is what a request may name
    response = client.post("/v1/completions", json={"prompt": "hi", "model": "sql"})
    assert response.status_code == 404


def test_tokenize_accepts_an_adapters_name(lora_client):
    response = lora_client.post("/tokenize", json={"prompt": "hi", "model": "sql"})
    assert response.status_code == 200 and response.json()["tokens"]


RUNTIME = {"enable_lora": True, "allow_runtime_lora_updating": True}


@pytest.fixture
def runtime_client(client_with):
    return client_with(**RUNTIME)


def test_the_runtime_routes_exist_only_when_allowed(lora_client):
    body = {"lora_name": "x", "lora_path": "/tmp"}
    assert lora_client.post("/v1/load_lora_adapter", json=body).status_code == 404
    assert lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404


def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(runtime_client, engine, tmp_path):
    load = {"lora_name": "sql", "lora_path": str(tmp_path)}
    response = runtime_client.post("/v1/load_lora_adapter", json=load)
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'sql' added successfully."
    assert [card["id"] for card in runtime_client.get("/v1/models").json()["data"]][1:] == ["sql"]
    completion = {"prompt": "hi", "model": "sql", "max_tokens": 2}
    assert runtime_client.post("/v1/completions", json=completion).status_code == 200
    assert engine.requests[-1][2].lora == "sql"
    response = runtime_client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'sql' removed successfully."
    assert runtime_client.post("/v1/completions", json=completion).status_code == 404
    response = runtime_client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."


def test_a_second_load_of_a_name_needs_load_inplace(runtime_client, engine, tmp_path):
    load = {"lora_name": "sql", "lora_path": str(tmp_path)}
    assert runtime_client.post("/v1/load_lora_adapter", json=load).status_code == 200
    response = runtime_client.post("/v1/load_lora_adapter", json=load)
    assert response.status_code == 400 and "load_inplace" in response.json()["error"]["message"]
    replace = load | {"load_inplace": True}
    assert runtime_client.post("/v1/load_lora_adapter", json=replace).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"lora_name": "", "lora_path": "/tmp"}, 400, "must be provided"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "fake-model", "lora_path": "/tmp"}, 400, "conflicts with the served model"),
        ({"lora_name": "x", "lora_path": "/no/such/folder"}, 404, "No LoRA adapter folder"),
        ({"lora_name": "x", "lora_path": 7}, 400, "lora_path"),
    ],
)
def test_a_load_that_cannot_be_done_is_a_client_error(runtime_client, engine, body, status, says):
    response = runtime_client.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == status, response.text
    assert says in str(response.json()["error"])
    assert engine.lora_adapters == {}


def test_an_adapter_the_engine_refuses_is_a_400_naming_why(runtime_client, engine, tmp_path):
    engine.lora_failure = LoRAError("LoRA adapter 'x': DoRA adapters are not supported")
    response = runtime_client.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == engine.lora_failure.args[0]
    assert response.json()["error"]["param"] == "lora_path"


def test_the_runtime_routes_need_the_api_key(client_with, tmp_path):
    keyed = client_with(api_key="k", **RUNTIME)
    load = {"lora_name": "x", "lora_path": str(tmp_path)}
    assert keyed.post("/v1/load_lora_adapter", json=load).status_code == 401
    assert keyed.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 401
