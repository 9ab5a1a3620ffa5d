"""End to end: a LoRA adapter served with vLLM's flags (`--enable-lora --lora-modules
name=path`) and run by naming it as the model, through the official `openai` client: the
adapter's greedy tokens are Hugging Face's for the model with the adapter's terms, beside the
base model's in the same server."""

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
        "--enable-lora", "--lora-modules", f"sql={folder}",
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


def test_the_adapter_runs_by_its_name_beside_the_base_model(served, hf_model):
    client, url, terms = served
    models = [model.id for model in client.models.list().data]
    assert models[1:] == ["sql"]
    prompt = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    with_adapter = copy.deepcopy(hf_model)
    for path, (a, b, scale) in terms.items():
        parent, _, leaf = path.rpartition(".")
        owner = with_adapter.get_submodule(parent)
        setattr(owner, leaf, ReferenceLoRA(getattr(owner, leaf), a, b, scale))
    for model, reference_model in ((models[0], hf_model), ("sql", with_adapter)):
        reference = hf_greedy_reference(reference_model, prompt, MAX_TOKENS)
        assert_matches_reference(_token_ids(client, model), reference, f"served {model}")
    assert _token_ids(client, "sql") != _token_ids(client, models[0])
