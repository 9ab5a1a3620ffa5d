"""bfloat16 linears packed once for oneDNN: the same bits as `nn.Linear`, tied embeddings kept,
applied only to bfloat16 CPU models on CPUs with native bf16, and by the loader."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pagedserve.configs.engine import DEFAULT_MODEL, ModelConfig
from pagedserve.engine.model_loader import load_model
from pagedserve.engine.packed_linear import PackedLinear, can_pack, pack_linears
from tests.engine.conftest import make_tiny_model

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
    assert isinstance(bf16.lm_head, PackedLinear)
    assert isinstance(bf16.model.layers[0].self_attn.q_proj, PackedLinear)
    assert isinstance(bf16.model.layers[0].mlp.gate_up_proj, PackedLinear)  # fused, then packed
    fp32 = load_model(ModelConfig(model=DEFAULT_MODEL, dtype="float32"), "cpu").model
    assert not any(isinstance(m, PackedLinear) for m in fp32.modules())
    assert type(fp32.model.layers[0].self_attn.q_proj) is nn.Linear
