"""End to end: a LoRA adapter served with vLLM's flags (`--enable-lora --lora-modules
name=path`) and run by naming it as the model, through the official `openai` client: the
adapter's greedy tokens are Hugging Face's for the model with the adapter's terms, beside the
base model's in the same server. Another, loaded over HTTP while serving
(`--allow-runtime-lora-updating`, vLLM's /v1/load_lora_adapter), runs the same way until it is
unloaded."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine.model_loader import DEFAULT_MODEL, resolve_model_path
from tests.engine.conftest import assert_matches_reference, hf_greedy_reference
from tests.engine.test_lora import ADAPTERS, ReferenceLoRA, write_adapter
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 8
PROMPT = "Write a query that lists every user:"


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    path = resolve_model_path(DEFAULT_MODEL)[0]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_model) -> Iterator[tuple[openai.OpenAI, str, dict]]:
    folder = tmp_path_factory.mktemp("lora") / "sql"
    terms = write_adapter(folder, hf_model, ADAPTERS["sql"], seed=0)
    process = ServerProcess(
        "--dtype", "float32", "--num-kv-blocks", "128",
        "--enable-lora", "--lora-modules", f"sql={folder}", "--allow-runtime-lora-updating",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", timeout=300)
        yield client, process.url, terms
    finally:
        process.stop()


def _token_ids(client: openai.OpenAI, model: str) -> list[int]:
    choice = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]
    return choice.model_extra["token_ids"]


def _with_terms(hf_model: torch.nn.Module, terms: dict) -> torch.nn.Module:
    model = copy.deepcopy(hf_model)
    for path, (a, b, scale) in terms.items():
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, ReferenceLoRA(getattr(owner, leaf), a, b, scale))
    return model


def _prompt(url: str) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]


def test_the_adapter_runs_by_its_name_beside_the_base_model(served, hf_model):
    client, url, terms = served
    models = [model.id for model in client.models.list().data]
    assert models[1:] == ["sql"]
    for model, reference_model in ((models[0], hf_model), ("sql", _with_terms(hf_model, terms))):
        reference = hf_greedy_reference(reference_model, _prompt(url), MAX_TOKENS)
        assert_matches_reference(_token_ids(client, model), reference, f"served {model}")
    assert _token_ids(client, "sql") != _token_ids(client, models[0])


def test_an_adapter_loaded_while_serving_runs_until_unloaded(served, hf_model, tmp_path):
    client, url, _ = served
    terms = write_adapter(tmp_path / "chat", hf_model, ADAPTERS["chat"], seed=1)
    load = {"lora_name": "chat", "lora_path": str(tmp_path / "chat")}
    response = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert response.status_code == 200, response.text
    assert [model.id for model in client.models.list().data][1:] == ["sql", "chat"]
    reference = hf_greedy_reference(_with_terms(hf_model, terms), _prompt(url), MAX_TOKENS)
    assert_matches_reference(_token_ids(client, "chat"), reference, "loaded while serving")
    response = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert response.status_code == 200, response.text
    with pytest.raises(openai.NotFoundError):
        _token_ids(client, "chat")
    assert [model.id for model in client.models.list().data][1:] == ["sql"]
