"""MLP with [gate; up] in one matmul and SiLU-and-multiply in one C++ pass: within two bfloat16 ulps
of Hugging Face's intermediate (and equal almost everywhere) in bfloat16, within eight float32 ulps
in float32, on every ISA build; swapped for every family that computes LlamaMLP's formula with
SiLU, left alone elsewhere, and, over the default model, as close to float32 as the module is."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from pagedserve.cache.attention.cpu import host_runnable_isas, load_cpu_kernel
from pagedserve.engine import model_loader
from pagedserve.engine.fused_mlp import (
    FusedMLP,
    can_fuse_mlps,
    computes_llama_mlp,
    fuse_mlps,
)
from pagedserve.engine.module_swap import FUSED_TOLERANCE_EPS, within_fused_tolerance
from tests.engine.conftest import load_default_on_cpu, make_tiny_model, mean_logit_errors


def assert_close_to_the_module(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and within_fused_tolerance(got, expected)
    if got.dtype == torch.bfloat16:  # rounding flips are rare (float32's last bits often differ)
        assert (got != expected).float().mean() <= 1e-3


def llama_mlp(
    hidden: int, intermediate: int, seed: int, bias: bool = False, dtype=torch.bfloat16
) -> LlamaMLP:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, mlp_bias=bias)
    torch.manual_seed(seed)
    return LlamaMLP(config).to(dtype).eval()


@pytest.mark.parametrize("isa", host_runnable_isas())
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_the_modules_intermediate_to_its_tolerance(isa, rows, dtype):
    kernel = load_cpu_kernel(isa)
    generator = torch.Generator().manual_seed(rows)
    for scale in (1e-3, 1.0, 30.0, 300.0):  # SiLU's tails: near 0, typical, saturated both ways
        gate, up = (
            (scale * torch.randn(rows, 1536, generator=generator)).to(dtype) for _ in range(2)
        )
        expected = nn.functional.silu(gate) * up
        assert_close_to_the_module(kernel.silu_mul(torch.cat([gate, up], dim=-1)), expected)


@pytest.mark.parametrize("isa", host_runnable_isas())
def test_silu_mul_is_atens_silu_for_every_bfloat16_gate(isa):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gate = bits.view(torch.bfloat16)
    gate = gate[~gate.float().isnan()]
    gate_up = torch.stack([gate, torch.ones_like(gate)], dim=1)  # rows of [g; 1]
    got = load_cpu_kernel(isa).silu_mul(gate_up).reshape(-1)
    # Exactly, with NaN where ATen has one (silu(-inf) = -inf / inf).
    torch.testing.assert_close(got, nn.functional.silu(gate), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("isa", host_runnable_isas())
def test_bfloat16_silu_mul_is_the_modules_bit_for_bit_for_every_gate(isa):
    # Every bfloat16 bit pattern as a gate (NaNs too), each with an up of its own, in rows as wide
    # as the default model's MLP (the vector loop, a table lookup per gate): the module's
    # SiLU rounded to bfloat16, times up, rounded again; NaN where it has NaN (of any payload).
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = (4 * torch.randn(gate.numel(), generator=torch.Generator().manual_seed(0))).bfloat16()
    gate_up = torch.cat([gate.view(-1, 1024), up.view(-1, 1024)], dim=1)
    got = load_cpu_kernel(isa).silu_mul(gate_up)
    expected = nn.functional.silu(gate.view(-1, 1024)) * up.view(-1, 1024)
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_silu_mul_keeps_leading_dimensions_and_reads_views():
    kernel = load_cpu_kernel()
    gate_up = torch.randn(2, 3, 2 * 40).to(torch.bfloat16)
    assert kernel.silu_mul(gate_up).shape == (2, 3, 40)
    transposed = torch.randn(80, 5).to(torch.bfloat16).T  # not contiguous
    expected = nn.functional.silu(transposed[:, :40]) * transposed[:, 40:]
    assert_close_to_the_module(kernel.silu_mul(transposed), expected)
    special = torch.tensor([[float("inf"), float("-inf"), 0.0, 2.0, 1.0, 1.0, 0.0, 5.0]])
    special = special.to(torch.bfloat16)
    reference = nn.functional.silu(special[:, :4]) * special[:, 4:]  # inf, NaN, 0, 8.8
    torch.testing.assert_close(kernel.silu_mul(special), reference, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="even"):
        kernel.silu_mul(torch.randn(2, 5).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.silu_mul(torch.randn(2, 4).to(torch.float16))


@pytest.mark.parametrize("isa", host_runnable_isas())
def test_float32_silu_is_within_four_ulps_of_atens_from_minus_100_to_100(isa):
    # Gates 0.001 apart from -100 to 100, in rows of 1,000 (the op's vector loop): ATen's exp is
    # SLEEF's, this one a polynomial of its own; each SiLU is within 1.5 ulps of the exact value,
    # so they part by a few ulps at most.
    gate = torch.linspace(-100.0, 100.0, 200_000).view(200, 1_000)
    got = load_cpu_kernel(isa).silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    expected = nn.functional.silu(gate)
    ulps = (got.view(torch.int32).long() - expected.view(torch.int32).long()).abs()
    assert ulps.max() <= 4
    assert (ulps > 0).float().mean() <= 0.2  # most are ATen's bits


@pytest.mark.parametrize("isa", host_runnable_isas())
def test_float32_silu_of_special_gates_is_atens(isa):
    gate = torch.tensor(
        [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 88.73, -88.73, -1e30]
    )
    gate = gate.repeat(4)  # 32 lanes: the vector loop, not only its tail
    got = load_cpu_kernel(isa).silu_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    expected = nn.functional.silu(gate)  # inf, NaN, NaN, 0, -0, 88.73, -0 (underflow), -0
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), expected.signbit())


def silu_mul_object(isa: str, *command: str) -> str:
    """The output of a binutils `command` run on the ISA build's silu_mul.o."""
    kernel_file = Path(load_cpu_kernel(isa).__file__)
    object_file = str(kernel_file.parent / "silu_mul.o")
    return subprocess.run(
        [*command, object_file], check=True, capture_output=True, text=True
    ).stdout


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
@pytest.mark.parametrize("isa", host_runnable_isas())
def test_silu_mul_calls_no_scalar_math_function(isa):
    # A libm call in the per-element loop (std::fmin, std::exp, ...) keeps GCC from vectorising
    # it: a NaN-safe std::fmin/fmax clamp once made the op ten times slower with the same bits.
    undefined = silu_mul_object(isa, "nm", "--undefined-only", "--format=just-symbols").split()
    scalar_math = {"expf", "exp", "fminf", "fmaxf", "fmin", "fmax", "exp2f", "ldexpf"}
    assert not scalar_math & set(undefined), sorted(scalar_math & set(undefined))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
@pytest.mark.parametrize("isa", host_runnable_isas())
def test_float32_silu_mul_divides_whole_vectors(isa):
    # SiLU's one division per gate in 256- or 512-bit registers: GCC 12 once left the float32 loop
    # scalar on AVX2 builds (a vdivss per gate, ~5x slower), as it would any loop whose selects
    # jump threading turns into branches that may trap (silu_mul.cpp).
    listing = silu_mul_object(isa, "objdump", "-d", "--no-show-raw-insn")
    divisions = [line for line in listing.splitlines() if "vdivps" in line]
    assert any("%ymm" in line or "%zmm" in line for line in divisions), divisions


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_mlp_computes_the_modules_output(bias, dtype):
    mlp = llama_mlp(64, 160, seed=3, bias=bias, dtype=dtype)
    fused = FusedMLP(mlp, load_cpu_kernel())
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        expected, got = mlp(x).float(), fused(x).float()
    # Past down_proj, a flipped intermediate ulp is summed with others: compare as a whole.
    tolerance = FUSED_TOLERANCE_EPS[dtype] * torch.finfo(dtype).eps
    assert (got - expected).abs().max() <= 4 * tolerance * expected.abs().max()


def test_only_silu_modules_that_compute_llamas_formula_are_eligible():
    assert computes_llama_mlp(LlamaMLP) and computes_llama_mlp(Qwen2MLP)
    assert computes_llama_mlp(GemmaMLP)  # the same forward, but GELU: fuse_mlps checks that too
    assert not computes_llama_mlp(Phi3MLP)  # already one gate_up_proj, another forward
    assert not computes_llama_mlp(nn.Linear)
    gemma_like = llama_mlp(32, 64, seed=0)
    gemma_like.act_fn = nn.GELU(approximate="tanh")
    holder = nn.Sequential(gemma_like)
    assert fuse_mlps(holder) == 0 and holder[0] is gemma_like


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-gqa", "mistral-gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_mlp_of_a_cpu_model_is_swapped_and_the_logits_stay_close(
    family, dtype, default_tokenizer
):
    model = make_tiny_model(family, default_tokenizer).model.to(dtype)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(model.config.vocab_size, (1, 24), generator=generator)
    with torch.inference_mode():
        before = model(input_ids).logits.float()
    down = model.model.layers[0].mlp.down_proj
    assert fuse_mlps(model) == model.config.num_hidden_layers
    assert model.model.layers[0].mlp.down_proj is down  # kept, not copied
    assert not any(computes_llama_mlp(type(m)) for m in model.modules())
    with torch.inference_mode():
        after = model(input_ids).logits.float()
    assert (after - before).abs().mean() <= 0.02 * before.abs().mean()


def test_float32_and_bfloat16_cpu_models_are_fused_float16_ones_not(default_tokenizer):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    assert can_fuse_mlps(model)
    assert can_fuse_mlps(model.to(torch.bfloat16))
    assert not can_fuse_mlps(model.to(torch.float16))


@pytest.mark.slow
def test_the_loader_fuses_both_dtypes_and_bfloat16_stays_as_close_to_float32_as_the_module(
    default_model_path, default_tokenizer, default_hf_model, monkeypatch
):
    fused = load_default_on_cpu("bfloat16")
    assert sum(isinstance(m, FusedMLP) for m in fused.modules()) == 30
    assert isinstance(load_default_on_cpu("float32").model.layers[0].mlp, FusedMLP)
    monkeypatch.setattr(model_loader, "can_fuse_mlps", lambda model: False)
    # The same bfloat16 model (packed, fused norms) with HF's MLP.
    plain = load_default_on_cpu("bfloat16")
    assert type(plain.model.layers[0].mlp) is LlamaMLP
    errors = mean_logit_errors(
        {"fused": fused, "module": plain}, default_hf_model, default_tokenizer
    )
    assert errors["fused"] <= 1.15 * errors["module"], errors


def test_without_a_kernel_build_the_model_keeps_its_modules(default_tokenizer, monkeypatch):
    from pagedserve.cache.attention import cpu

    def no_compiler(isa=None):
        raise RuntimeError("injected: no C++ compiler")

    monkeypatch.setattr(cpu, "load_cpu_kernel", no_compiler)
    model = make_tiny_model("llama-gqa", default_tokenizer).model.to(torch.bfloat16)
    assert fuse_mlps(model) == 0
    assert all(computes_llama_mlp(type(layer.mlp)) for layer in model.model.layers)
