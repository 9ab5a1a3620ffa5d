"""bfloat16 linears that multiply in float32 on a CPU without native bf16: each output within one
bf16 ulp of the bf16 layer's own, through whichever float32 module computes it (plain, the skinny
kernel, oneDNN's packed copy); applied by the loader only to bfloat16 CPU models on such a CPU (the
host's flags stood in for here, so it runs on every CI machine); tied weights stay tied; and the
engine's greedy tokens on the default model are Hugging Face's bfloat16 choices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.cache.attention.cpu import load_cpu_kernel
from pagedserve.configs.engine import DEFAULT_MODEL, ModelConfig
from pagedserve.engine import model_loader, packed_linear, skinny_linear, widened_linear
from pagedserve.engine.fused_attention import FusedAttention
from pagedserve.engine.fused_mlp import FusedMLP
from pagedserve.engine.model_loader import load_model
from pagedserve.engine.packed_linear import PackedLinear
from pagedserve.engine.skinny_linear import EVERY_LAYER_ROWS, SkinnyLinear
from pagedserve.engine.widened_linear import (
    WidenedLinear,
    can_widen_linears,
    computes_linears_in_float32,
    widen_linears,
    within_one_bfloat16_ulp,
)
from tests.engine.conftest import (
    add_requests,
    greedy_params,
    hugging_face_linears,
    make_engine,
    make_tiny_model,
    run_to_completion,
    teacher_forced_shortfalls,
)

AVX2 = frozenset({"avx2", "fma"})
AVX512_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})


def _bf16_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    torch.manual_seed(in_features + out_features)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("inner", ["plain", "skinny", "packed"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_widened_linear_is_its_bf16_layer_to_one_ulp_through_any_float32_module(inner, bias):
    linear = _bf16_linear(576, 193, bias)
    widened = WidenedLinear(linear)
    assert widened.inner.weight.dtype == torch.float32
    assert torch.equal(widened.inner.weight.to(torch.bfloat16), linear.weight)  # an exact copy
    if inner == "skinny":
        widened.inner = SkinnyLinear(widened.inner, load_cpu_kernel(), rows=(1, 16))
    elif inner == "packed":
        widened.inner = PackedLinear(widened.inner)
    for rows in (1, 7, 16, 300):
        assert within_one_bfloat16_ulp(linear, widened, rows=rows)
    x = torch.randn(2, 3, 576).to(torch.bfloat16)
    with torch.inference_mode():
        assert widened(x).dtype == torch.bfloat16 and widened(x).shape == (2, 3, 193)


def test_the_ulp_check_tells_a_wrong_layer_apart():
    linear = _bf16_linear(64, 32, bias=False)
    wrong = WidenedLinear(linear)
    with torch.no_grad():
        wrong.inner.weight[3, 5] += 0.5
    assert not within_one_bfloat16_ulp(linear, wrong)


def test_only_bfloat16_cpu_models_on_cpus_without_native_bf16_are_widened(default_tokenizer):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    assert not can_widen_linears(model, flags=AVX2)  # float32: nothing to widen
    model = model.to(torch.bfloat16)
    assert can_widen_linears(model, flags=AVX2)
    assert not can_widen_linears(model, flags=AVX512_BF16)
    assert not computes_linears_in_float32(model)
    num_linears = sum(type(m) is nn.Linear for m in model.modules())
    head_weight = model.lm_head.weight
    assert widen_linears(model) == num_linears
    assert computes_linears_in_float32(model)
    assert not any(
        type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 for m in model.modules()
    )
    if model.config.tie_word_embeddings:  # the head keeps the embeddings' bf16 weight reachable
        assert model.lm_head.weight is head_weight is model.model.embed_tokens.weight
    assert widen_linears(model) == 0  # already widened: nothing left to do


@pytest.fixture
def no_native_bf16(monkeypatch):
    """The host seen as an AVX2-only CPU by every check the loader makes."""
    for module in (model_loader, packed_linear, skinny_linear, widened_linear):
        monkeypatch.setattr(module, "host_cpu_flags", lambda: AVX2)


@pytest.fixture
def widened_default(no_native_bf16, default_model_path):
    config = ModelConfig(model=DEFAULT_MODEL, dtype="bfloat16", cpu_float32_linear="onednn")
    return load_model(config, "cpu")


def test_the_loader_widens_a_bfloat16_model_and_runs_its_float32_fast_paths(widened_default):
    model = widened_default.model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, FusedMLP)  # fused first, then its [gate; up] linear widened
    assert isinstance(layer.self_attn, FusedAttention)  # and its [q; k; v] linear
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)
    for linear in (*linears, model.lm_head):
        assert isinstance(linear, WidenedLinear)
        # AVX2 only, oneDNN: 1-16 rows through the kernel, the rest through the packed copy
        assert isinstance(linear.inner, SkinnyLinear)
        assert (linear.inner.min_rows, linear.inner.max_rows) == EVERY_LAYER_ROWS
        assert isinstance(linear.inner.fallback, PackedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with hugging_face_linears(model):  # references get bf16 nn.Linear back, the same weights
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
        o_proj = model.model.layers[0].self_attn.o_proj
        assert type(o_proj) is nn.Linear and o_proj.weight.dtype == torch.bfloat16
    assert isinstance(model.lm_head, WidenedLinear) and isinstance(
        model.lm_head.inner, SkinnyLinear
    )


PROMPTS = [
    "In 1969, Apollo 11",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n",
    "The three laws of thermodynamics are",
]
MAX_NEW_TOKENS = 32
# Measured: 0.125 at most (one bf16 ulp of a logit between 16 and 32), 127 of 128 the argmax.
LOGPROB_SLACK = 0.25


@pytest.mark.slow
def test_widened_greedy_tokens_are_hugging_face_bfloat16_choices(widened_default):
    """Teacher-forced, as tests/engine/test_kv_cache_dtype.py checks a rounded cache: bf16 outputs
    summed in another order can flip a rounding, and one flip at a near-tie sends a free-running
    continuation elsewhere. Each token must be (nearly) the reference's best given the engine's own
    earlier tokens; a wrong weight or layer misses by whole nats."""
    tokenizer = widened_default.tokenizer
    prompts = {f"p{i}": tokenizer.encode(text) for i, text in enumerate(PROMPTS)}
    engine = make_engine(widened_default, dtype="bfloat16", block_size=16)
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    token_ids = run_to_completion(engine).token_ids
    shortfalls = [
        teacher_forced_shortfalls(widened_default.model, prompt, token_ids[request_id])
        for request_id, prompt in prompts.items()
    ]
    for request_id, shortfall in zip(prompts, shortfalls, strict=True):
        assert len(shortfall) == MAX_NEW_TOKENS
        assert (shortfall <= LOGPROB_SLACK).all(), (
            f"{request_id}: {shortfall.max():.3g} below HF's best at {int(shortfall.argmax())}"
        )
    argmax_hits = sum(int((shortfall == 0).sum()) for shortfall in shortfalls)
    assert argmax_hits >= 0.95 * len(prompts) * MAX_NEW_TOKENS
