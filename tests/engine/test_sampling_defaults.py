"""The model's sampling defaults (engine/sampling_defaults.py): what its generation config sets,
nothing it leaves at transformers' defaults, and nothing under --generation-config vllm."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import GenerationConfig

from pagedserve.configs.engine import ModelConfig
from pagedserve.engine.sampling_defaults import model_sampling_defaults
from tests.engine.conftest import make_engine, make_tiny_model

AUTO, VLLM = ModelConfig(), ModelConfig(generation_config="vllm")


def _model(**fields: object) -> SimpleNamespace:
    return SimpleNamespace(generation_config=GenerationConfig(**fields))


def test_only_the_sampling_fields_the_config_sets_are_defaults():
    qwen3_like = _model(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, eos_token_id=2)
    assert model_sampling_defaults(qwen3_like, AUTO) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    assert model_sampling_defaults(_model(eos_token_id=2, max_length=64), AUTO) == {}
    assert model_sampling_defaults(_model(repetition_penalty=1.1), AUTO) == {
        "repetition_penalty": 1.1
    }


def test_a_default_out_of_range_is_dropped_with_a_warning_and_an_integral_top_k_kept(caplog):
    model = _model(do_sample=True, top_p=0.0, top_k=20.0, temperature=0.7)
    with caplog.at_level("WARNING", logger="pagedserve.engine.sampling_defaults"):
        defaults = model_sampling_defaults(model, AUTO)
    assert defaults == {"top_k": 20, "temperature": 0.7} and type(defaults["top_k"]) is int
    assert any("top_p=0.0" in record.getMessage() for record in caplog.records)


def test_vllm_mode_and_a_model_without_a_generation_config_have_none():
    assert model_sampling_defaults(_model(temperature=0.6, do_sample=True), VLLM) == {}
    assert model_sampling_defaults(SimpleNamespace(), AUTO) == {}


def test_the_default_model_ships_no_sampling_defaults(default_loaded):
    assert model_sampling_defaults(default_loaded.model, AUTO) == {}


def test_the_engine_serves_its_models_defaults(default_tokenizer):
    loaded = make_tiny_model("llama-gqa", default_tokenizer)
    loaded.model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=5)
    assert make_engine(loaded).sampling_defaults == {"temperature": 0.7, "top_k": 5}
