"""RMSNorm in one C++ pass: within two bfloat16 ulps of Hugging Face's module (and equal almost
everywhere) in bfloat16, within eight float32 ulps in float32, for every family that computes
LlamaRMSNorm's formula; a bfloat16 model as close to the float32 one as with the module, left alone
where the formula differs, and applied by the loader in both dtypes."""

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
    FusedRMSNorm,
    can_fuse_norms,
    computes_llama_rms_norm,
    fuse_rms_norms,
)
from pagedserve.engine.module_swap import within_fused_tolerance
from tests.engine.conftest import load_default_on_cpu, make_tiny_model, mean_logit_errors

# Rows, batches, q/k norms, and a wide row (a sum of 8,192 squares).
SHAPES = [(1, 576), (64, 576), (2, 7, 576), (3, 4, 64), (5, 1536), (4, 8192)]


def assert_close_to_the_module(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and within_fused_tolerance(got, expected)
    if got.dtype == torch.bfloat16:  # rounding flips are rare (in float32, 1 / rms's last bit
        assert (got != expected).float().mean() <= 1e-3  # moves a whole row by an ulp)


@pytest.mark.parametrize("isa", host_runnable_isas())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_norm_matches_the_module_to_its_tolerance(isa, shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=generator))
    fused = FusedRMSNorm(norm, load_cpu_kernel(isa))
    strided = torch.randn(shape[-1], 2 * shape[0], generator=generator).to(dtype).T
    inputs = [
        (scale * torch.randn(shape, generator=generator)).to(dtype) for scale in (1e-3, 1.0, 300.0)
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_eligible_norm_of_a_cpu_model_is_swapped_keeping_its_weight(
    family, dtype, default_tokenizer
):
    model = make_tiny_model(family, default_tokenizer).model.to(dtype)
    final_norm_weight = model.model.norm.weight
    per_layer = 4 if family.startswith("qwen3") else 2  # Qwen3 also norms q and k per head
    assert fuse_rms_norms(model) == per_layer * model.config.num_hidden_layers + 1  # + final
    assert model.model.norm.weight is final_norm_weight  # the same Parameter, no copy
    assert not any(computes_llama_rms_norm(type(m)) for m in model.modules())


def test_float32_and_bfloat16_cpu_models_are_fused_float16_ones_not(default_tokenizer):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    assert can_fuse_norms(model)
    assert can_fuse_norms(model.to(torch.bfloat16))
    assert not can_fuse_norms(model.to(torch.float16))  # no float16 op


@pytest.mark.slow
def test_the_loader_fuses_both_dtypes_and_bfloat16_stays_as_close_to_float32_as_the_module(
    default_model_path, default_tokenizer, default_hf_model
):
    fused = load_default_on_cpu("bfloat16")
    assert sum(isinstance(m, FusedRMSNorm) for m in fused.modules()) == 2 * 30 + 1
    assert isinstance(load_default_on_cpu("float32").model.norm, FusedRMSNorm)
    plain = load_default_on_cpu("bfloat16")
    for parent in list(plain.modules()):  # the same bfloat16 model with Hugging Face's norms
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedRMSNorm):
                norm = LlamaRMSNorm(child.weight.shape[0], child.variance_epsilon)
                norm.weight = child.weight
                setattr(parent, name, norm)
    errors = mean_logit_errors(
        {"fused": fused, "module": plain}, default_hf_model, default_tokenizer
    )
    assert errors["fused"] <= 1.15 * errors["module"], errors
