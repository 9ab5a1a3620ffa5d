"""Decoder layers that call the kernels directly (engine/direct_layer.py): the module path's logits
bit for bit in every step that takes the direct path, the module path wherever a step is not the
plain case, and only Llama's formula over the fused norms, attention and MLP is swapped."""

from __future__ import annotations

import pytest
import torch

from pagedserve.configs import SamplingParams
from pagedserve.engine.direct_layer import (
    DirectDecoderLayer,
    can_use_direct_layers,
    use_direct_layers,
)
from pagedserve.engine.fused_attention import fuse_attention
from pagedserve.engine.fused_mlp import fuse_mlps
from pagedserve.engine.fused_norm import fuse_rms_norms
from pagedserve.engine.kept_rows import KeptRowsDecoderLayer, keep_rows_in_last_layer
from pagedserve.engine.model_loader import LoadedModel
from pagedserve.engine.panel_linear import swap_in_panel_linears
from tests.engine.conftest import make_engine, make_tiny_model
from tests.engine.test_speculative import spec_json

# Prompts of several chunks under a 16-token budget, and short ones finishing beside them.
PROMPTS = {f"p{i}": [(7 * i + j * j) % 60 + 3 for j in range(4 + 9 * i)] for i in range(5)}


def _fused(family: str, tokenizer, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A tiny model with the loader's CPU swaps that direct layers build on."""
    loaded = make_tiny_model(family, tokenizer)
    model = loaded.model.to(dtype)
    fuse_mlps(model)
    fuse_attention(model)
    keep_rows_in_last_layer(model)
    swap_in_panel_linears(model)  # where the build has the panel kernel (AVX-512)
    fuse_rms_norms(model)
    return loaded


def _each_step_both_ways(loaded, params, monkeypatch, **settings):
    """Runs PROMPTS to completion; each step's batch also runs with every layer on its module path.
    Returns, per step, (direct calls, logits, module-path logits)."""
    engine = make_engine(loaded, dtype=str(loaded.model.dtype).removeprefix("torch."), **settings)
    direct_calls = []
    direct = DirectDecoderLayer._direct

    def counted(self, *args):
        direct_calls[-1] += 1
        return direct(self, *args)

    monkeypatch.setattr(DirectDecoderLayer, "_direct", counted)
    steps, forward = [], engine.runner.forward

    def both_ways(batch):
        # The module path first: a second forward stores the same K/V at the same slots again.
        with monkeypatch.context() as patch:
            patch.setattr(DirectDecoderLayer, "_is_plain", lambda *_: False)
            direct_calls.append(0)
            module_logits = forward(batch)
            assert direct_calls[-1] == 0
        logits = forward(batch)
        steps.append((direct_calls[-1], logits, module_logits))
        return logits

    engine.runner.forward = both_ways
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("speculation", [False, True])
def test_direct_layers_give_the_module_paths_logits_bit_for_bit(
    default_tokenizer, monkeypatch, dtype, speculation
):
    loaded = _fused("llama-gqa", default_tokenizer, dtype)
    layers = loaded.model.config.num_hidden_layers
    assert use_direct_layers(loaded.model) == layers - 1, "all but the kept-rows layer"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    settings = dict(block_size=4, max_num_batched_tokens=16)
    if speculation:
        settings["speculative_config"] = spec_json(k=3)
    steps = _each_step_both_ways(loaded, params, monkeypatch, **settings)
    assert len(steps) > 10
    for calls, logits, module_logits in steps:
        assert calls == layers - 1, "every step of this engine is a plain paged step"
        assert torch.equal(logits, module_logits)


@pytest.mark.parametrize(
    "settings",
    [dict(attention_backend="torch"), dict(kv_cache_dtype="bfloat16"), dict(kv_cache_dtype="fp8")],
    ids=["torch backend", "bfloat16 cache", "fp8 cache"],
)
def test_steps_that_are_not_the_plain_case_take_the_module_path(
    default_tokenizer, monkeypatch, settings
):
    loaded = _fused("llama-gqa", default_tokenizer)
    assert use_direct_layers(loaded.model)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    steps = _each_step_both_ways(loaded, params, monkeypatch, block_size=4, **settings)
    for calls, logits, module_logits in steps:
        assert calls == 0
        assert torch.equal(logits, module_logits)


def test_outside_the_engine_the_layer_is_hugging_faces(default_tokenizer):
    loaded = _fused("llama-gqa", default_tokenizer)
    model = loaded.model
    probe = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.inference_mode():
        before = model(probe).logits
        use_direct_layers(model)
        after = model(probe).logits  # no paged context: each layer runs its class's forward
    assert torch.equal(before, after)


def test_only_llama_layers_over_the_fused_modules_are_swapped(default_tokenizer):
    unfused = make_tiny_model("llama-gqa", default_tokenizer).model
    assert can_use_direct_layers(unfused) and not can_use_direct_layers(unfused.half())
    unfused.float()
    assert use_direct_layers(unfused) == 0, "its norms, attention and MLP are Hugging Face's"
    loaded = _fused("llama-gqa", default_tokenizer)
    model = loaded.model
    names = [name for name, _ in model.named_parameters()]
    first = model.model.layers[0]
    use_direct_layers(model)
    swapped = model.model.layers[0]
    assert isinstance(swapped, DirectDecoderLayer) and not swapped.training
    assert swapped.self_attn is first.self_attn and swapped.mlp is first.mlp
    assert isinstance(model.model.layers[-1], KeptRowsDecoderLayer)
    assert [name for name, _ in model.named_parameters()] == names, "the state dict is unchanged"
    assert use_direct_layers(model) == 0, "and only once"
    # Qwen3 normalises q and k: its attention stays unfused, so its layers stay Hugging Face's.
    assert use_direct_layers(_fused("qwen3-gqa", default_tokenizer).model) == 0


def test_the_default_model_calls_the_kernels_directly(default_loaded):
    layers = default_loaded.model.model.layers
    assert all(isinstance(layer, DirectDecoderLayer) for layer in layers[:-1])
    assert isinstance(layers[-1], KeptRowsDecoderLayer)
