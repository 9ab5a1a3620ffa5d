"""LoRA adapters loaded and unloaded while serving (engine/runtime_lora.py), on the default model:
an adapter loaded at run time gives Hugging Face's greedy tokens with its terms; a request keeps
the load it was queued with when its adapter is replaced or unloaded meanwhile, and that load's
terms are freed once its last request ends; a replaced adapter's requests never reuse blocks
the old weights computed; a load that fails leaves what was served as it was."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedserve.configs import EngineConfig, SamplingParams
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora import LoRAError, LoRALinear
from tests.engine.conftest import assert_matches_reference, run_to_completion
from tests.engine.test_lora import _engine, _reference, write_adapter

SPEC = ((0, 1, 29), ("q_proj", "v_proj", "down_proj"), 8, 16, False)
MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def weights(tmp_path_factory, default_hf_model) -> dict[str, tuple[str, dict]]:
    """Two adapters of the same shape and other weights: "v1" and "v2"."""
    root = tmp_path_factory.mktemp("runtime-lora")
    return {
        name: (str(root / name), write_adapter(root / name, default_hf_model, SPEC, seed))
        for seed, name in enumerate(("v1", "v2"), start=3)
    }


@pytest.fixture
def engine(default_model_path) -> LLMEngine:
    return _engine(default_model_path, [])  # --enable-lora, nothing loaded at start


def _params(lora: str | None, max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, lora=lora)


def _loads_held(engine: LLMEngine) -> set[int]:
    """The numbers of the loads whose terms some wrapper still holds."""
    return {
        number
        for module in engine.runner.model.modules()
        if isinstance(module, LoRALinear)
        for number in module.deltas
    }


def test_a_request_keeps_its_load_through_a_replace_and_an_unload(
    engine, weights, default_hf_model
):
    adapters = engine.runner.lora
    prompt = engine.tokenizer.encode("Write a query that lists every user:")
    adapters.load("sql", weights["v1"][0])
    engine.add_request("old", prompt, _params("sql"))
    deltas = engine.step() + engine.step() + engine.step()
    adapters.load("sql", weights["v2"][0], replace=True)  # "old" runs on with v1
    engine.add_request("new", prompt, _params("sql"))
    deltas += engine.step()
    adapters.unload("sql")  # both run on; new requests may not name it
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'sql'"):
        engine.add_request("late", prompt, _params("sql"))
    assert _loads_held(engine) == {1, 2}
    run = run_to_completion(engine)
    for request_id, version in (("old", "v1"), ("new", "v2")):
        earlier = [
            t for delta in deltas if delta.request_id == request_id for t in delta.new_token_ids
        ]
        reference = _reference(default_hf_model, weights[version][1], prompt)
        token_ids = earlier + run.token_ids[request_id]
        assert len(token_ids) == MAX_NEW_TOKENS
        assert_matches_reference(token_ids, reference, f"{request_id} on {version}")
    adapters.drop_retired(engine.scheduler.requests.values())
    assert _loads_held(engine) == set() and adapters.paths == {} and not adapters.retiring


def test_retired_terms_stay_while_a_request_runs_them(engine, weights):
    adapters = engine.runner.lora
    adapters.load("sql", weights["v1"][0])
    engine.add_request("r", [1, 2, 3, 4], _params("sql", max_tokens=4))
    engine.step()
    adapters.unload("sql")
    adapters.drop_retired(engine.scheduler.requests.values())
    assert _loads_held(engine) == {1}  # "r" still runs load 1
    run_to_completion(engine)
    adapters.drop_retired(engine.scheduler.requests.values())
    assert _loads_held(engine) == set()


def test_a_request_validated_before_an_unload_is_refused_when_queued(engine, weights):
    engine.runner.lora.load("sql", weights["v1"][0])
    validated = engine.validate_request("r", [1, 2, 3], _params("sql"))
    engine.runner.lora.unload("sql")
    with pytest.raises(InvalidRequestError, match="'sql' has been unloaded"):
        engine.add_validated_request(validated)
    assert not engine.has_unfinished_requests()


def test_a_replaced_adapter_never_reuses_the_old_weights_blocks(engine, weights):
    adapters = engine.runner.lora
    prompt = engine.tokenizer.encode("A long shared prefix. " * 12)
    cached = []
    for step, (path, replace) in enumerate(
        [(weights["v1"][0], False), (None, False), (weights["v2"][0], True), (None, False)]
    ):
        if path is not None:
            adapters.load("sql", path, replace=replace)
        engine.add_request(f"r{step}", prompt, _params("sql", max_tokens=1))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        cached.append(max(delta.num_cached_prompt_tokens for delta in deltas))
    assert cached[0] == 0 and cached[1] > 0  # one load shares its blocks
    assert cached[2] == 0 and cached[3] > 0  # the new weights compute their own


def test_a_load_that_fails_leaves_the_served_adapters_as_they_were(
    engine, weights, tmp_path, default_hf_model
):
    adapters = engine.runner.lora
    adapters.load("sql", weights["v1"][0])
    held, paths = _loads_held(engine), dict(adapters.paths)
    # Layer 0's terms fit; layer 1's lora_A has another width: refused after layer 0 went in.
    wrong = {"base_model.model.model.layers.1.mlp.down_proj.lora_A.weight": torch.zeros(8, 64)}
    wrong["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"] = torch.zeros(576, 8)
    write_adapter(tmp_path / "bad", default_hf_model, ((0,), ("q_proj",), 8, 8, False), 0, wrong)
    for name, replace in (("bad", False), ("sql", True)):
        with pytest.raises(LoRAError, match="lora_A has 64 columns"):
            adapters.load(name, tmp_path / "bad", replace=replace)
        assert _loads_held(engine) == held and adapters.paths == paths
    with pytest.raises(LoRAError, match="already loaded"):
        adapters.load("sql", weights["v2"][0])
    with pytest.raises(KeyError):
        adapters.unload("nope")


def test_the_async_engine_loads_and_frees_on_its_thread(engine, weights, default_hf_model):
    prompt = engine.tokenizer.encode("Tell me a joke about cats.")

    async def scenario() -> tuple[list[int], set[int]]:
        async_engine = AsyncEngine(EngineConfig())
        async_engine.engine = engine
        await async_engine.start()
        try:
            await async_engine.load_lora_adapter("sql", weights["v1"][0])
            assert async_engine.lora_adapters == {"sql": weights["v1"][0]}
            stream = async_engine.generate(prompt, _params("sql"), "r")
            token_ids = list((await anext(stream)).new_token_ids)
            await async_engine.unload_lora_adapter("sql")
            assert async_engine.lora_adapters == {}
            async for delta in stream:
                token_ids += delta.new_token_ids
            with pytest.raises(KeyError):
                await async_engine.unload_lora_adapter("sql")
            return token_ids, await async_engine._on_engine_thread(_loads_held)
        finally:
            await async_engine.shutdown()

    token_ids, held = asyncio.run(scenario())
    reference = _reference(default_hf_model, weights["v1"][1], prompt)
    assert_matches_reference(token_ids, reference, "loaded at run time")
    assert held == set()  # freed after the request's last step


def test_a_load_that_fails_for_any_reason_leaves_no_terms_behind(engine, weights, monkeypatch):
    adapters = engine.runner.lora
    calls = []
    original = LoRALinear.add

    def add_until_memory_runs_out(self, adapter, part, delta):
        calls.append(adapter)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected")
        original(self, adapter, part, delta)

    monkeypatch.setattr(LoRALinear, "add", add_until_memory_runs_out)
    with pytest.raises(torch.OutOfMemoryError):
        adapters.load("sql", weights["v1"][0])
    assert _loads_held(engine) == set() and adapters.paths == {}
