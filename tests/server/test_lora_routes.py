"""LoRA adapters at the HTTP layer (fake engine): a request runs an adapter by naming it as its
model (vLLM's convention), /v1/models lists the adapters after the model, and any other name is
still a 404. The engine's side (the adapters' terms) is tests/engine/test_lora.py's."""

from __future__ import annotations

import pytest

from tests.server.conftest import FakeEngine

ADAPTERS = {"enable_lora": True, "lora_modules": ["sql=/adapters/sql", "chat=/adapters/chat"]}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def lora_client(client_with):
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


def test_an_unknown_model_is_a_404_and_adapters_need_lora_modules(client, lora_client):
    for test_client in (client, lora_client):
        response = test_client.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
        assert response.status_code == 404
    response = client.post("/v1/completions", json={"prompt": "hi", "model": "sql"})
    assert response.status_code == 404  # no adapters served


def test_tokenize_accepts_an_adapters_name(lora_client):
    response = lora_client.post("/tokenize", json={"prompt": "hi", "model": "sql"})
    assert response.status_code == 200 and response.json()["tokens"]
