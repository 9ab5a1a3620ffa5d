"""vLLM's --hf-overrides and --override-generation-config: config values set before the model
loads (the engine's context length follows them), and sampling defaults over the model's."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from pagedserve.configs import load_engine_config
from pagedserve.configs.engine import ModelConfig
from pagedserve.engine.hf_overrides import apply_overrides
from pagedserve.engine.model_loader import load_model
from pagedserve.engine.sampling_defaults import model_sampling_defaults
from tests.engine.conftest import (
    greedy_params,
    hf_greedy_reference,
    make_engine,
    make_tiny_model,
    run_to_completion,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama-gqa", default_tokenizer).model.save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return folder


def _load(folder, **settings):
    return load_model(ModelConfig(model=str(folder), dtype="float32", **settings), "cpu")


def test_overrides_reach_the_model_and_the_engine_s_context_length(tiny_folder, caplog):
    plain = _load(tiny_folder)
    assert plain.max_model_len == plain.hf_config.max_position_embeddings > 48
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.hf_overrides"):
        loaded = _load(
            tiny_folder,
            hf_overrides='{"max_position_embeddings": 48, "rms_norm_eps": 0.001, "my_flag": 1}',
        )
    assert loaded.max_model_len == 48 and loaded.model.config.rms_norm_eps == 0.001
    assert loaded.model.model.norm.variance_epsilon == 0.001  # built from the overridden config
    assert loaded.hf_config.my_flag == 1
    warnings = [record.getMessage() for record in caplog.records]
    assert warnings == ["hf_overrides: the model's config has no my_flag; set anyway"]


def test_a_rope_scaling_override_keeps_rope_theta_and_decodes_as_hugging_face(tiny_folder):
    # vLLM's example override: linear RoPE scaling. transformers 5 names it rope_parameters; the
    # object merges into the checkpoint's, whose rope_theta it must keep.
    plain = _load(tiny_folder).hf_config.rope_parameters
    rope = '{"rope_scaling": {"rope_type": "linear", "factor": 4.0}}'
    loaded = _load(tiny_folder, hf_overrides=rope)
    assert loaded.hf_config.rope_parameters == {**plain, "rope_type": "linear", "factor": 4.0}
    reference_model = AutoModelForCausalLM.from_pretrained(
        tiny_folder, config=loaded.hf_config, dtype=torch.float32
    ).eval()
    engine = make_engine(loaded)
    prompt = list(range(5, 45))
    engine.add_request("r", prompt, greedy_params(max_tokens=12))
    expected = hf_greedy_reference(reference_model, prompt, 12).token_ids
    assert run_to_completion(engine).token_ids["r"] == expected


@pytest.mark.parametrize("name", ["architectures", "classifier_from_token"])
def test_overrides_that_would_turn_the_checkpoint_into_another_model_are_refused(tiny_folder, name):
    with pytest.raises(ValueError, match=f"hf_overrides: {name} is not overridden here"):
        _load(tiny_folder, hf_overrides=json.dumps({name: ["X"]}))


def test_an_object_over_a_sub_config_sets_its_fields():
    outer = PretrainedConfig(vocab_size=10)
    outer.text_config = PretrainedConfig(hidden_size=8, num_layers=2)
    apply_overrides(outer, {"text_config": {"hidden_size": 16}, "vocab_size": 12})
    assert isinstance(outer.text_config, PretrainedConfig)
    assert (outer.text_config.hidden_size, outer.text_config.num_layers) == (16, 2)
    assert outer.vocab_size == 12


def _model(**fields):
    return type("Model", (), {"generation_config": GenerationConfig(**fields)})()


def test_override_generation_config_goes_over_the_model_s_defaults_or_alone():
    qwen3_like = _model(do_sample=True, temperature=0.6, top_k=20)
    over = '{"temperature": 0.2, "top_k": 5.0}'
    auto = load_engine_config(cli={"override_generation_config": over}, environ={}).model
    assert model_sampling_defaults(qwen3_like, auto) == {"temperature": 0.2, "top_k": 5}
    assert type(model_sampling_defaults(qwen3_like, auto)["top_k"]) is int
    # vLLM's set: the penalties too, and max_new_tokens as the default max_tokens.
    more = ModelConfig(override_generation_config={"presence_penalty": 0.5, "max_new_tokens": 64.0})
    assert model_sampling_defaults(_model(), more) == {"presence_penalty": 0.5, "max_tokens": 64}
    vllm = ModelConfig(generation_config="vllm", override_generation_config={"min_p": 0.1})
    assert model_sampling_defaults(qwen3_like, vllm) == {"min_p": 0.1}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"temp": 0.5}', "temp not among temperature, top_p, top_k, min_p, repetition_penalty"),
        ('{"max_new_tokens": -1}', "max_tokens"),
        ('{"top_p": 0.0}', "top_p"),
        ("[1]", "override_generation_config must be a JSON object"),
        ("{", "override_generation_config is not valid JSON"),
    ],
)
def test_a_bad_override_is_refused_with_the_config(value, message):
    with pytest.raises(ValidationError, match=message):
        load_engine_config(cli={"override_generation_config": value}, environ={})
