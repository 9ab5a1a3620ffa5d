"""bfloat16 RMSNorm in one C++ pass: within two bfloat16 ulps of Hugging Face's module (and equal
almost everywhere) for every family that computes LlamaRMSNorm's formula, as close to the float32
model as the module over a whole model, left alone where the formula differs or the model is
float32, and applied by the loader."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from pagedserve.cache.attention.cpu import host_runnable_isas, load_cpu_kernel
from pagedserve.engine.fused_norm import (
    TOLERANCE,
    FusedRMSNorm,
    can_fuse_norms,
    computes_llama_rms_norm,
    fuse_rms_norms,
)
from tests.engine.conftest import load_default_on_cpu, make_tiny_model, mean_logit_errors

SHAPES = [(1, 576), (64, 576), (2, 7, 576), (3, 4, 64), (5, 1536)]  # rows, batches, q/k norms


def assert_close_to_the_module(got: torch.Tensor, expected: torch.Tensor) -> None:
    got, expected = got.float(), expected.float()
    assert ((got - expected).abs() <= TOLERANCE * expected.abs()).all()
    assert (got != expected).float().mean() <= 1e-3  # rounding flips are rare


@pytest.mark.parametrize("isa", host_runnable_isas())
@pytest.mark.parametrize("shape", SHAPES)
def test_the_fused_norm_matches_the_module_to_two_ulps_and_almost_everywhere_exactly(isa, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=generator))
    fused = FusedRMSNorm(norm, load_cpu_kernel(isa))
    strided = torch.randn(shape[-1], 2 * shape[0], generator=generator).to(torch.bfloat16).T
    inputs = [
        (scale * torch.randn(shape, generator=generator)).to(torch.bfloat16)
        for scale in (1e-3, 1.0, 300.0)
    ]  # small, typical and large activations
    if len(shape) == 2:
        inputs.append(strided[:, : shape[-1]])  # a transposed view: read through .contiguous()
    with torch.inference_mode():
        for x in inputs:
            assert_close_to_the_module(fused(x), norm(x))


def test_only_modules_that_compute_llamas_formula_are_eligible():
    assert computes_llama_rms_norm(LlamaRMSNorm) and computes_llama_rms_norm(Qwen3RMSNorm)
    assert not computes_llama_rms_norm(GemmaRMSNorm)  # scales by 1 + weight
    assert not computes_llama_rms_norm(Olmo2RMSNorm)  # multiplies before the downcast
    assert not computes_llama_rms_norm(nn.LayerNorm)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-gqa"])
def test_every_eligible_norm_of_a_bfloat16_model_is_swapped_keeping_its_weight(
    family, default_tokenizer
):
    model = make_tiny_model(family, default_tokenizer).model.to(torch.bfloat16)
    final_norm_weight = model.model.norm.weight
    per_layer = 4 if family.startswith("qwen3") else 2  # Qwen3 also norms q and k per head
    assert fuse_rms_norms(model) == per_layer * model.config.num_hidden_layers + 1  # + final
    assert model.model.norm.weight is final_norm_weight  # the same Parameter, no copy
    assert not any(computes_llama_rms_norm(type(m)) for m in model.modules())


def test_float32_models_keep_hugging_faces_norm(default_tokenizer):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    assert not can_fuse_norms(model)
    assert can_fuse_norms(model.to(torch.bfloat16))


@pytest.mark.slow
def test_the_loader_fuses_bfloat16_as_close_to_float32_as_the_module_and_leaves_float32_alone(
    default_model_path, default_tokenizer
):
    fused, reference = load_default_on_cpu("bfloat16"), load_default_on_cpu("float32")
    assert sum(isinstance(m, FusedRMSNorm) for m in fused.modules()) == 2 * 30 + 1
    assert type(reference.model.norm) is LlamaRMSNorm
    plain = load_default_on_cpu("bfloat16")
    for parent in list(plain.modules()):  # the same bfloat16 model with Hugging Face's norms
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedRMSNorm):
                norm = LlamaRMSNorm(child.weight.shape[0], child.variance_epsilon)
                norm.weight = child.weight
                setattr(parent, name, norm)
    errors = mean_logit_errors({"fused": fused, "module": plain}, reference, default_tokenizer)
    assert errors["fused"] <= 1.15 * errors["module"], errors
