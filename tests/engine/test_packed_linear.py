"""Linears packed once for oneDNN. bfloat16: the same bits as `nn.Linear`, tied embeddings kept,
applied only on CPUs with native bf16. float32: within float32 rounding of `nn.Linear`, applied
where `cpu_float32_linear` resolves to onednn (auto: identified x86 CPUs). Both by the
loader."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pagedserve.cache.attention.cpu import load_cpu_kernel
from pagedserve.configs.engine import DEFAULT_MODEL, ModelConfig
from pagedserve.engine import panel_linear, skinny_linear
from pagedserve.engine.fused_attention import FusedAttention
from pagedserve.engine.model_loader import load_model
from pagedserve.engine.packed_linear import (
    PackedLinear,
    can_pack,
    can_pack_float32,
    float32_linear_backend,
    pack_linears,
)
from pagedserve.engine.panel_linear import PanelLinear
from pagedserve.engine.skinny_linear import EVERY_LAYER_ROWS, PACKED_ROWS, SkinnyLinear
from tests.engine.conftest import hugging_face_linears, make_tiny_model

needs_native_bf16 = pytest.mark.skipif(
    not can_pack(nn.Linear(1, 1).to(torch.bfloat16)),
    reason="this CPU has no native bf16 (AVX512_BF16/AMX) or torch lacks oneDNN's bf16 linear",
)


def _bf16_tiny(default_tokenizer) -> nn.Module:
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model.to(torch.bfloat16)


@needs_native_bf16
def test_packed_model_gives_bit_identical_logits_and_greedy_tokens(default_tokenizer):
    plain = _bf16_tiny(default_tokenizer)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert packed.lm_head.weight is packed.model.embed_tokens.weight  # still tied, not copied
    assert not hasattr(packed.model.layers[0].mlp.up_proj, "weight")  # untied: only the packed copy
    input_ids = torch.tensor([[5, 17, 300, 42, 999, 8, 64]])
    with torch.inference_mode():
        assert torch.equal(plain(input_ids).logits, packed(input_ids).logits)
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(
        plain.generate(input_ids, **settings), packed.generate(input_ids, **settings)
    )


def test_only_bfloat16_cpu_models_on_cpus_with_native_bf16_are_packed():
    assert not can_pack(nn.Linear(4, 4))  # float32: kept as HF computes it
    assert not can_pack(nn.Linear(4, 4).to(torch.bfloat16), flags=frozenset({"avx2", "fma"}))
    assert not can_pack(nn.Sequential())  # no parameters at all


@needs_native_bf16
def test_the_loader_packs_a_bfloat16_model_and_leaves_float32_alone(default_model_path):
    bf16 = load_model(ModelConfig(model=DEFAULT_MODEL, dtype="bfloat16"), "cpu").model
    attention = bf16.model.layers[0].self_attn
    assert isinstance(attention, FusedAttention)  # [q; k; v] fused, then packed

    def packed(layer: nn.Module) -> bool:  # on AVX-512 builds, the fallback of a panel layer
        return isinstance(layer.fallback if isinstance(layer, PanelLinear) else layer, PackedLinear)

    assert packed(bf16.lm_head)
    assert packed(attention.qkv_proj) and packed(attention.o_proj)
    assert packed(bf16.model.layers[0].mlp.gate_up_proj)  # fused, then packed
    config = ModelConfig(model=DEFAULT_MODEL, dtype="float32", cpu_float32_linear="mkl")
    fp32 = load_model(config, "cpu").model
    assert not any(isinstance(m, (PackedLinear, PanelLinear)) for m in fp32.modules())
    assert type(fp32.model.layers[0].self_attn.qkv_proj) is nn.Linear  # fused, left on MKL


def test_auto_runs_float32_linears_on_onednn_on_identified_x86_cpus():
    assert float32_linear_backend("auto", vendor="AuthenticAMD", machine="x86_64") == "onednn"
    assert float32_linear_backend("auto", vendor="HygonGenuine", machine="x86_64") == "onednn"
    assert float32_linear_backend("auto", vendor="GenuineIntel", machine="x86_64") == "onednn"
    assert float32_linear_backend("auto", vendor="", machine="x86_64") == "mkl"  # unknown CPU
    assert float32_linear_backend("auto", vendor="AuthenticAMD", machine="aarch64") == "mkl"
    for setting in ("mkl", "onednn"):  # an explicit setting wins on any CPU
        assert float32_linear_backend(setting, vendor="GenuineIntel", machine="x86_64") == setting
        assert float32_linear_backend(setting, vendor="AuthenticAMD", machine="x86_64") == setting


def test_float32_packing_applies_to_float32_cpu_models_when_the_setting_says_onednn():
    assert can_pack_float32(nn.Linear(4, 4), "onednn")
    assert not can_pack_float32(nn.Linear(4, 4), "mkl")
    assert not can_pack_float32(nn.Linear(4, 4).to(torch.bfloat16), "onednn")
    assert not can_pack_float32(nn.Sequential(), "onednn")


def test_packed_float32_model_stays_within_rounding_and_gives_hf_its_linears_back(
    default_tokenizer,
):
    plain = make_tiny_model("llama-gqa", default_tokenizer).model
    plain.config.tie_word_embeddings = True
    plain.tie_weights()
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert packed.lm_head.weight is packed.model.embed_tokens.weight  # still tied, not copied
    input_ids = torch.tensor([[5, 17, 300, 42, 999, 8, 64]])
    with torch.inference_mode():
        expected = plain(input_ids).logits
        got = packed(input_ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # float32 rounding apart
        with hugging_face_linears(packed):  # a reference sees Hugging Face's exact computation
            assert type(packed.model.layers[0].mlp.down_proj) is nn.Linear
            assert torch.equal(packed(input_ids).logits, expected)
    assert isinstance(packed.model.layers[0].mlp.down_proj, PackedLinear)  # and back again


@pytest.mark.parametrize(
    ("flags", "skinny_layers"),
    [
        (frozenset({"avx2", "fma", "avx512f"}), "panels"),  # an AVX-512 build: Zen 4, SPR
        (frozenset({"avx2", "fma"}), "every layer"),  # Zen 3
        (frozenset({"fma"}), "head"),  # an x86 CPU without AVX2
    ],
)
def test_the_loader_packs_float32_for_onednn_or_keeps_mkl_with_the_skinny_head(
    default_model_path, monkeypatch, flags, skinny_layers
):
    def load(setting: str) -> nn.Module:
        config = ModelConfig(model=DEFAULT_MODEL, dtype="float32", cpu_float32_linear=setting)
        return load_model(config, "cpu").model

    monkeypatch.setattr(skinny_linear, "host_cpu_flags", lambda: flags)
    # Panels go where the kernel build is AVX-512 (16 lanes): stand in for it either way.
    on_avx512 = skinny_layers == "panels"
    lanes = load_cpu_kernel().vector_lanes if on_avx512 else -1
    monkeypatch.setattr(panel_linear, "PANEL_LANES", lanes)
    onednn = load("onednn")
    q_proj = onednn.model.layers[0].self_attn.qkv_proj  # [q; k; v] fused, then swapped
    # Without AVX2: the head's 1-8 rows through the kernel, the rest packed. With panels, every
    # layer's 1-128 rows through the panel kernel, the head's 1-8 through the skinny one.
    if skinny_layers in ("head", "panels"):
        if on_avx512:
            assert isinstance(q_proj, PanelLinear) and isinstance(q_proj.fallback, PackedLinear)
        else:
            assert isinstance(q_proj, PackedLinear)
        rows = PACKED_ROWS
    else:  # AVX2: every layer's 1-16 rows through the kernel, the rest packed
        assert isinstance(q_proj, SkinnyLinear) and isinstance(q_proj.fallback, PackedLinear)
        assert (q_proj.min_rows, q_proj.max_rows) == EVERY_LAYER_ROWS
        rows = EVERY_LAYER_ROWS
    assert isinstance(onednn.lm_head, SkinnyLinear)
    assert (onednn.lm_head.min_rows, onednn.lm_head.max_rows) == rows
    assert isinstance(onednn.lm_head.fallback, PackedLinear)
    assert onednn.lm_head.weight is onednn.model.embed_tokens.weight
    mkl = load("mkl")
    assert type(mkl.model.layers[0].self_attn.qkv_proj) is nn.Linear
    assert isinstance(mkl.lm_head, SkinnyLinear)
