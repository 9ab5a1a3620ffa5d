"""Attention with fused q/k/v and the rotary embedding in C++ (engine/fused_attention.py), float32
and bfloat16: the rotation is Hugging Face's to the bit in both, and only Llama's formula is
swapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.gemma.modeling_gemma import GemmaAttention
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from pagedserve.cache.attention.cpu import host_runnable_isas, load_cpu_kernel
from pagedserve.engine import model_loader
from pagedserve.engine.fused_attention import (
    FusedAttention,
    can_fuse_attention,
    computes_llama_attention,
    fuse_attention,
)
from tests.engine.conftest import load_default_on_cpu, make_tiny_model, mean_logit_errors


@pytest.mark.parametrize("isa", host_runnable_isas())
@pytest.mark.parametrize(("tokens", "head_dim"), [(1, 64), (37, 64), (300, 128), (4, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_hugging_faces_rotation_bit_for_bit(isa, tokens, head_dim, dtype):
    kernel = load_cpu_kernel(isa)
    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads = 9, 3
    for scale in (1e-3, 1.0, 300.0):
        qkv = scale * torch.randn(1, tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
        qkv = qkv.to(dtype)
        # Real angles, then a wider range: the arithmetic must match for any cos and sin (in
        # float32, an FMA in place of a multiply and an add would not).
        angles = torch.randn(1, tokens, head_dim // 2, generator=generator) * tokens
        cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
        sin = torch.cat([angles.sin() * 3] * 2, dim=-1).to(dtype)
        q, k, v = (
            part.view(1, tokens, -1, head_dim).transpose(1, 2)
            for part in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        )
        expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
        expected_v = v.clone()
        kernel.rope_(qkv.view(tokens, -1), cos[0], sin[0], heads + kv_heads, head_dim)
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
        assert torch.equal(v, expected_v)  # heads past num_heads are left alone


def test_rope_rejects_what_it_cannot_rotate():
    kernel = load_cpu_kernel()
    rows, table = (
        torch.zeros(4, 128, dtype=torch.bfloat16),
        torch.zeros(4, 64, dtype=torch.bfloat16),
    )
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.rope_(rows.float(), table, table, 2, 64)
    with pytest.raises(RuntimeError, match="takes float32 or bfloat16"):
        kernel.rope_(rows.half(), table.half(), table.half(), 2, 64)
    with pytest.raises(RuntimeError, match="exceed"):
        kernel.rope_(rows, table, table, 3, 64)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernel.rope_(rows, table[:3], table[:3], 2, 64)


def bfloat16_attention(bias: bool = False) -> LlamaAttention:
    config = LlamaConfig(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, attention_bias=bias
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaAttention(config, layer_idx=0).to(torch.bfloat16).eval()


@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_attention_computes_the_modules_output(bias):
    attention = bfloat16_attention(bias)
    fused = FusedAttention(attention, load_cpu_kernel())
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 11, 96, generator=generator).to(torch.bfloat16)
    angles = torch.randn(1, 11, 8, generator=generator)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    with torch.inference_mode():
        expected, _ = attention(x, position_embeddings=(cos, sin))
        got, _ = fused(x, position_embeddings=(cos, sin))
    assert torch.equal(got, expected)


def test_only_modules_that_compute_llamas_formula_are_eligible():
    assert computes_llama_attention(LlamaAttention) and computes_llama_attention(GemmaAttention)
    assert not computes_llama_attention(MistralAttention)  # passes its sliding window on
    assert not computes_llama_attention(Qwen3Attention)  # q and k normalised: another forward
    assert not computes_llama_attention(nn.Linear)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_attention_of_a_cpu_model_is_swapped_and_the_logits_stay_the_same(
    default_tokenizer, dtype
):
    model = make_tiny_model("llama-gqa", default_tokenizer).model.to(dtype)
    input_ids = torch.randint(model.config.vocab_size, (1, 24), generator=torch.Generator())
    with torch.inference_mode():
        before = model(input_ids).logits
    o_proj = model.model.layers[0].self_attn.o_proj
    assert fuse_attention(model) == model.config.num_hidden_layers
    assert model.model.layers[0].self_attn.o_proj is o_proj  # kept, not copied
    with torch.inference_mode():
        after = model(input_ids).logits
    if dtype == torch.bfloat16:
        assert torch.equal(after, before)
    else:  # the [q; k; v] matmul may sum in another order than the three
        torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_float32_and_bfloat16_cpu_models_are_fused_float16_ones_not(default_tokenizer):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    assert can_fuse_attention(model)
    assert can_fuse_attention(model.to(torch.bfloat16))
    assert not can_fuse_attention(model.to(torch.float16))


def test_without_a_kernel_build_the_model_keeps_its_modules(default_tokenizer, monkeypatch):
    from pagedserve.cache.attention import cpu

    def no_compiler(isa=None):
        raise RuntimeError("injected: no C++ compiler")

    monkeypatch.setattr(cpu, "load_cpu_kernel", no_compiler)
    model = make_tiny_model("llama-gqa", default_tokenizer).model.to(torch.bfloat16)
    assert fuse_attention(model) == 0
    assert all(type(layer.self_attn) is LlamaAttention for layer in model.model.layers)


@pytest.mark.slow
def test_the_loader_fuses_attention_in_both_dtypes_bfloat16_as_close_to_float32_as_the_module(
    default_model_path, default_tokenizer, default_hf_model, monkeypatch
):
    # Below 512 rows the [q; k; v] matmul gives the three projections' bits; from 512 rows oneDNN
    # blocks it differently and an ulp flips here and there (3 in 100,000 values): no further from
    # the float32 model than the module is.
    fused = load_default_on_cpu("bfloat16")
    assert sum(isinstance(m, FusedAttention) for m in fused.modules()) == 30
    assert isinstance(load_default_on_cpu("float32").model.layers[0].self_attn, FusedAttention)
    monkeypatch.setattr(model_loader, "can_fuse_attention", lambda model: False)
    # The same bfloat16 model (packed, fused MLP and norms) with HF's attention.
    plain = load_default_on_cpu("bfloat16")
    assert type(plain.model.layers[0].self_attn) is LlamaAttention
    errors = mean_logit_errors(
        {"fused": fused, "module": plain}, default_hf_model, default_tokenizer
    )
    assert errors["fused"] <= 1.15 * errors["module"], errors
