"""The float32 skinny linear kernel: within float32 rounding of `F.linear` at every row count it
takes, on every ISA build the host runs, for K that ends in a partial vector and odd N; the module
sends one row and prefill chunks to `F.linear` unchanged and keeps the weight Parameter (a tied
head stays tied); the loader swaps the LM head of float32 models (every layer where oneDNN's packed copies take
larger batches on a CPU with AVX2), and references run HF's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.cache.attention.cpu import host_runnable_isas, load_cpu_kernel
from pagedserve.engine.packed_linear import PackedLinear, pack_linears
from pagedserve.engine.skinny_linear import (
    EVERY_LAYER_ROWS,
    MAX_ROWS,
    MIN_ROWS,
    PACKED_ROWS,
    SkinnyLinear,
    can_use_skinny_linears,
    skinny_every_layer_on,
    use_skinny_linears,
)
from tests.engine.conftest import (
    hugging_face_linears,
    make_tiny_model,
    tiny_linears_and_logits,
)


def assert_float32_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    expected = F.linear(x, weight)
    scale = x.abs().reshape(-1, x.shape[-1]) @ weight.abs().T  # the summed magnitudes
    assert got.shape == expected.shape
    assert ((got - expected).abs().reshape(scale.shape) <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("isa", host_runnable_isas())
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 12, 16])
@pytest.mark.parametrize("shape", [(576, 576), (193, 576), (31, 1536), (70, 37)])
def test_the_kernel_matches_f_linear_to_float32_rounding(isa, rows, shape):
    generator = torch.Generator().manual_seed(rows * 1000 + shape[0])
    weight = torch.randn(shape, generator=generator)
    x = torch.randn(rows, shape[1], generator=generator)
    assert_float32_close(load_cpu_kernel(isa).skinny_linear_fp32(x, weight), x, weight)


def test_the_kernel_keeps_leading_dimensions_reads_views_and_refuses_what_it_cannot_do():
    kernel = load_cpu_kernel()
    weight = torch.randn(40, 64)
    x = torch.randn(1, 3, 64)
    assert_float32_close(kernel.skinny_linear_fp32(x, weight), x, weight)
    transposed = torch.randn(64, 5).T  # not contiguous
    assert_float32_close(kernel.skinny_linear_fp32(transposed, weight), transposed, weight)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        kernel.skinny_linear_fp32(torch.randn(17, 64), weight)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.skinny_linear_fp32(x.to(torch.bfloat16), weight)
    with pytest.raises(RuntimeError, match="last dimension"):
        kernel.skinny_linear_fp32(torch.randn(2, 63), weight)


class CountingKernel:
    """The extension's skinny kernel, recording how many rows each call got."""

    def __init__(self, kernel, calls: list[int]) -> None:
        self._kernel, self._calls = kernel, calls

    def skinny_linear_fp32(self, x, weight):
        self._calls.append(x.numel() // x.shape[-1])
        return self._kernel.skinny_linear_fp32(x, weight)


def test_the_module_uses_the_kernel_only_for_decode_sized_batches():
    linear = nn.Linear(64, 48)
    skinny = SkinnyLinear(linear, load_cpu_kernel())
    assert skinny.weight is linear.weight and skinny.bias is linear.bias
    calls: list[int] = []
    skinny._kernel = CountingKernel(skinny._kernel, calls)
    with torch.inference_mode():
        for rows in (1, MIN_ROWS, MAX_ROWS, MAX_ROWS + 1, 300):
            x = torch.randn(rows, 64)
            expected = linear(x)
            got = skinny(x)
            if MIN_ROWS <= rows <= MAX_ROWS:
                assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, expected)  # F.linear itself: the same bits
    assert calls == [MIN_ROWS, MAX_ROWS]


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-gqa"])
def test_only_the_lm_head_of_a_float32_model_is_swapped_and_ties_stay(family, default_tokenizer):
    model = make_tiny_model(family, default_tokenizer).model
    num_linears = sum(type(m) is nn.Linear for m in model.modules())
    head_weight = model.lm_head.weight
    assert can_use_skinny_linears(model)
    assert use_skinny_linears(model) == 1
    assert isinstance(model.lm_head, SkinnyLinear) and model.lm_head.weight is head_weight
    assert sum(type(m) is nn.Linear for m in model.modules()) == num_linears - 1
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert use_skinny_linears(model) == 0  # already swapped: nothing left to do
    assert not can_use_skinny_linears(model.to(torch.bfloat16))


def test_a_packed_model_sends_1_to_8_rows_to_the_kernel_and_the_rest_to_a_packed_head(
    default_tokenizer,
):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    head_weight = model.lm_head.weight
    assert use_skinny_linears(model, packed=True, every_layer=False) == 1
    num_packed = pack_linears(model)
    head = model.lm_head
    assert isinstance(head, SkinnyLinear) and isinstance(head.fallback, PackedLinear)
    assert head.weight is head_weight and (head.min_rows, head.max_rows) == PACKED_ROWS
    assert num_packed == sum(isinstance(m, PackedLinear) for m in model.modules()) - 1
    calls: list[int] = []
    head._kernel = CountingKernel(head._kernel, calls)
    with torch.inference_mode():
        for rows in (1, PACKED_ROWS[1], PACKED_ROWS[1] + 1, 64):
            x = torch.randn(rows, head.in_features)
            expected = head.fallback(x)
            got = head(x)
            assert_float32_close(got, x, head_weight)
            if rows > PACKED_ROWS[1]:
                assert torch.equal(got, expected)  # oneDNN's packed head itself
    assert calls == [1, PACKED_ROWS[1]]
    with hugging_face_linears(model):  # references still get Hugging Face's head
        assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is head_weight
    assert model.lm_head is head


def test_every_layer_sends_decode_batches_to_the_kernel_and_the_rest_to_its_packed_copy(
    default_tokenizer,
):
    model, linears, probe, expected_logits = tiny_linears_and_logits(default_tokenizer)
    assert use_skinny_linears(model, packed=True, every_layer=True) == len(linears)
    assert pack_linears(model) == 0  # nothing plain left to pack
    swapped = dict(model.named_modules())
    for name, linear in linears.items():
        layer = swapped[name]
        assert isinstance(layer, SkinnyLinear) and isinstance(layer.fallback, PackedLinear)
        assert (
            layer.weight is linear.weight and (layer.min_rows, layer.max_rows) == EVERY_LAYER_ROWS
        )
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    calls: list[int] = []
    for layer in swapped.values():
        if isinstance(layer, SkinnyLinear):
            layer._kernel = CountingKernel(layer._kernel, calls)
    with torch.inference_mode():
        logits = model(probe).logits  # 24 rows: every layer's packed copy
        assert calls == []
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        model(probe[:, : EVERY_LAYER_ROWS[1]])  # 16 rows: every layer through the kernel
    assert calls and set(calls) == {EVERY_LAYER_ROWS[1]}
    assert len(calls) == len(linears)
    with hugging_face_linears(model):
        assert not any(isinstance(m, SkinnyLinear) for m in model.modules())
    assert all(isinstance(swapped[name], SkinnyLinear) for name in linears)


def test_every_layer_needs_packed_layers_and_is_the_default_on_avx2_cpus(
    default_tokenizer,
):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    with pytest.raises(ValueError, match="needs packed"):
        use_skinny_linears(model, every_layer=True)
    assert skinny_every_layer_on(frozenset({"avx2", "fma"}))  # measured on Zen 3
    assert skinny_every_layer_on(frozenset({"avx2", "fma", "avx512f"}))  # Sapphire Rapids, Zen 4
    assert not skinny_every_layer_on(frozenset({"fma"}))
    assert not skinny_every_layer_on(frozenset({"neon"}))


def test_a_reference_runs_hugging_faces_head_and_the_skinny_one_comes_back(default_tokenizer):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    use_skinny_linears(model)
    skinny_head = model.lm_head
    with hugging_face_linears(model):
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight is skinny_head.weight
    assert model.lm_head is skinny_head
