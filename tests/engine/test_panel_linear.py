"""The panel linear kernel: within float32 rounding of `F.linear` (bfloat16: within one rounding of
the output) at every row count, on every ISA build the host runs, for K and N that end in a
partial vector or panel; it refuses what it cannot compute; the module sends 1-MAX_ROWS rows to
the kernel and the rest to its fallback; the loader's swap covers every decoder linear (and the LM
head in bfloat16, not in float32), packing then packs the fallbacks, and references get Hugging
Face's linears back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.cache.attention.cpu import host_runnable_isas, load_cpu_kernel
from pagedserve.engine.packed_linear import PackedLinear, can_pack, pack_linears
from pagedserve.engine.panel_linear import (
    AMX_BF16_MAX_ROWS,
    AMX_MAX_ROWS,
    MAX_ROWS,
    PANEL_LANES,
    PanelLinear,
    panel_dtype,
    panel_max_rows,
    panel_weight_mib,
    swap_in_panel_linears,
    use_panel_linears,
)
from tests.engine.conftest import (
    hugging_face_linears,
    make_tiny_model,
    tiny_linears_and_logits,
)

# (33, 80): in_features a multiple of 2 but not of 32, which AMX hosts multiply without tiles.
SHAPES = [(576, 576), (193, 576), (31, 1536), (70, 37), (33, 80), (1, 5), (960, 1)]
ROWS = [1, 2, 5, 11, 12, 13, 64, 128, 200]


def assert_close_to_f_linear(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """float32: a few ulps of the summed magnitudes. bfloat16: that, plus one bfloat16 rounding
    of the output (a sum on a rounding boundary may round the other way)."""
    expected = F.linear(x.float(), weight.float())
    scale = x.float().abs().reshape(-1, x.shape[-1]) @ weight.float().abs().T
    bound = 1e-5 * scale.reshape(expected.shape) + 1e-30
    if x.dtype == torch.bfloat16:
        bound = bound + torch.finfo(torch.bfloat16).eps * expected.abs()
    assert got.shape == expected.shape and got.dtype == x.dtype
    assert ((got.float() - expected).abs() <= bound).all()


def bf16_kernels() -> list[str]:
    return [isa for isa in host_runnable_isas() if load_cpu_kernel(isa).panel_bf16]


@pytest.mark.parametrize("isa", host_runnable_isas())
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_matches_f_linear_at_every_row_count(isa, shape):
    kernel = load_cpu_kernel(isa)
    generator = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    weight = torch.randn(shape, generator=generator)
    panels = kernel.pack_panels(weight)
    assert panels.shape == (-(-shape[0] // kernel.panel_width), shape[1], kernel.panel_width)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=generator)
        assert_close_to_f_linear(kernel.panel_linear(x, panels, shape[0]), x, weight)


BF16_KERNELS = bf16_kernels() or [pytest.param(None, marks=pytest.mark.skip(reason="no BF16"))]


@pytest.mark.parametrize("isa", BF16_KERNELS)
@pytest.mark.parametrize("shape", [shape for shape in SHAPES if shape[1] % 2 == 0])
def test_bfloat16_matches_f_linear_to_one_rounding(isa, shape):
    kernel = load_cpu_kernel(isa)
    generator = torch.Generator().manual_seed(shape[0] * 11 + shape[1])
    weight = torch.randn(shape, generator=generator).to(torch.bfloat16)
    panels = kernel.pack_panels(weight)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=generator).to(torch.bfloat16)
        assert_close_to_f_linear(kernel.panel_linear(x, panels, shape[0]), x, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wrong_column_or_pair_order_would_fail(dtype):
    """The tolerance is far tighter than what a layout mistake does."""
    kernel = load_cpu_kernel()
    if dtype == torch.bfloat16 and not kernel.panel_bf16:
        pytest.skip("no AVX512_BF16 in this build")
    weight = torch.randn(40, 64).to(dtype)
    x = torch.randn(3, 64).to(dtype)
    swapped = weight.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # two output columns exchanged
    with pytest.raises(AssertionError):
        assert_close_to_f_linear(kernel.panel_linear(x, kernel.pack_panels(swapped), 40), x, weight)
    shifted = weight.roll(1, dims=1)  # k off by one
    with pytest.raises(AssertionError):
        assert_close_to_f_linear(kernel.panel_linear(x, kernel.pack_panels(shifted), 40), x, weight)


def test_the_kernel_keeps_leading_dimensions_reads_views_and_refuses_what_it_cannot_do():
    kernel = load_cpu_kernel()
    weight = torch.randn(40, 64)
    panels = kernel.pack_panels(weight)
    x = torch.randn(1, 3, 64)
    assert_close_to_f_linear(kernel.panel_linear(x, panels, 40), x, weight)
    transposed = torch.randn(64, 5).T  # not contiguous
    assert_close_to_f_linear(kernel.panel_linear(transposed, panels, 40), transposed, weight)
    assert kernel.panel_linear(torch.randn(0, 64), panels, 40).shape == (0, 40)
    with pytest.raises(RuntimeError, match="last dimension"):
        kernel.panel_linear(torch.randn(2, 63), panels, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        kernel.panel_linear(torch.randn(2, 64), panels, 40 + kernel.panel_width)
    with pytest.raises(RuntimeError, match="same dtype"):
        kernel.panel_linear(torch.randn(2, 64, dtype=torch.float64), panels, 40)
    with pytest.raises(RuntimeError, match=r"\[out_features, in_features\]"):
        kernel.pack_panels(torch.randn(64))
    with pytest.raises(RuntimeError, match="pack_panels"):  # not a contiguous layout
        kernel.panel_linear(x, panels.transpose(0, 1), 40)
    if not kernel.panel_bf16:
        with pytest.raises(RuntimeError, match="AVX512_BF16"):
            kernel.pack_panels(weight.to(torch.bfloat16))
        return
    bf16 = kernel.pack_panels(weight.to(torch.bfloat16))  # K = 64: 32 pairs
    with pytest.raises(RuntimeError, match="even in_features"):
        kernel.pack_panels(torch.randn(40, 63).to(torch.bfloat16))
    for k in (63, 65):  # pairs of k: an input one short or one long is refused, not padded
        with pytest.raises(RuntimeError, match="last dimension"):
            kernel.panel_linear(torch.randn(2, k).to(torch.bfloat16), bf16, 40)


class CountingKernel:
    """The extension's panel kernel, recording how many rows each call got."""

    def __init__(self, kernel, calls: list[int]) -> None:
        self._kernel, self._calls = kernel, calls

    def panel_linear(self, x, panels, out_features):
        self._calls.append(x.numel() // x.shape[-1])
        return self._kernel.panel_linear(x, panels, out_features)


def test_the_module_sends_decode_batches_to_the_kernel_and_the_rest_to_its_fallback():
    linear = nn.Linear(64, 48)  # with a bias, which the kernel leaves to the module
    panel = PanelLinear(linear, load_cpu_kernel())
    assert panel.fallback is linear and "panels" not in panel.state_dict()
    calls: list[int] = []
    panel._kernel = CountingKernel(panel._kernel, calls)
    with torch.inference_mode():
        for rows in (1, MAX_ROWS, MAX_ROWS + 1, 300):
            x = torch.randn(rows, 64)
            got, expected = panel(x), linear(x)
            if rows <= MAX_ROWS:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, expected)  # the fallback itself
    assert calls == [1, MAX_ROWS]


def test_the_swap_covers_every_linear_but_the_head_and_packing_packs_the_fallbacks(
    default_tokenizer,
):
    model, linears, probe, expected_logits = tiny_linears_and_logits(default_tokenizer)
    assert use_panel_linears(model, torch.float32) == len(linears) - 1
    assert type(model.lm_head) is nn.Linear and panel_weight_mib(model) > 0
    assert pack_linears(model) == len(linears)  # each fallback, and the head
    swapped = dict(model.named_modules())
    for name in linears:
        layer = swapped[name]
        if name != "lm_head":
            assert isinstance(layer, PanelLinear) and isinstance(layer.fallback, PackedLinear)
    calls: list[int] = []
    for layer in swapped.values():
        if isinstance(layer, PanelLinear):
            layer._kernel = CountingKernel(layer._kernel, calls)
    with torch.inference_mode():
        torch.testing.assert_close(model(probe).logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert calls and set(calls) == {24} and len(calls) == len(linears) - 1
    with hugging_face_linears(model):
        assert not any(isinstance(m, (PanelLinear, PackedLinear)) for m in model.modules())
    assert all(isinstance(swapped[name], PanelLinear) for name in linears if name != "lm_head")
    assert use_panel_linears(model, torch.float32) == 0  # nothing plain left


@pytest.mark.parametrize("isa", BF16_KERNELS)
def test_a_bfloat16_swap_covers_the_head_too_and_packing_packs_its_fallback(isa, default_tokenizer):
    model, linears, probe, _ = tiny_linears_and_logits(default_tokenizer)
    model = model.to(torch.bfloat16)
    if not can_pack(model):
        pytest.skip("no native bf16 here: bfloat16 linears are widened, not packed")
    with torch.inference_mode():
        expected = model(probe).logits
    kernel = load_cpu_kernel(isa)
    assert use_panel_linears(model, torch.bfloat16, kernel, max_rows=MAX_ROWS) == len(linears)
    assert isinstance(model.lm_head, PanelLinear)
    assert pack_linears(model) == len(linears)  # each fallback, the head's included
    assert isinstance(model.lm_head.fallback, PackedLinear)
    calls: list[int] = []
    model.lm_head._kernel = CountingKernel(model.lm_head._kernel, calls)
    with torch.inference_mode():
        got = model(probe).logits
    assert calls == [24]
    # Every layer's sums in another order, each output within one bfloat16 rounding: the logits
    # move by a few bfloat16 steps at most, nowhere near a wrong layer's difference.
    assert (got.float() - expected.float()).abs().max() <= 0.1 * expected.float().abs().max()
    with torch.inference_mode():  # the head alone: within one rounding of F.linear
        hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
        assert_close_to_f_linear(model.lm_head(hidden), hidden, linears["lm_head"].weight)


def test_which_models_get_panels(default_tokenizer):
    model = make_tiny_model("llama-gqa", default_tokenizer).model
    assert panel_dtype(model, "mkl") is None  # Hugging Face's exact float32 sums were asked for
    kernel = load_cpu_kernel()
    on_avx512 = kernel.vector_lanes == PANEL_LANES
    assert panel_dtype(model, "onednn") == (torch.float32 if on_avx512 else None)
    bf16 = model.to(torch.bfloat16)
    native = on_avx512 and kernel.panel_bf16 and can_pack(bf16)
    assert panel_dtype(bf16) == (torch.bfloat16 if native else None)
    if native:  # and the loader's own step swaps them, each with the host's row limit
        assert swap_in_panel_linears(bf16) == torch.bfloat16
        q_proj = bf16.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, PanelLinear)
        assert q_proj.max_rows == panel_max_rows(torch.bfloat16)


def test_amx_hosts_send_bfloat16_decode_batches_to_the_kernels_tiles_or_one_row_without_them():
    # On AMX the kernel's tiles beat oneDNN up to AMX_MAX_ROWS; without the tiles, oneDNN's AMX
    # linear beats the kernel from two rows (module docstring). float32 and CPUs with AVX512_BF16
    # alone keep the kernel up to MAX_ROWS.
    amx = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    bf16_only = frozenset({"avx512f", "avx512_bf16"})
    assert panel_max_rows(torch.bfloat16, amx, amx_panels=True) == AMX_MAX_ROWS == 64
    assert panel_max_rows(torch.bfloat16, amx, amx_panels=False) == AMX_BF16_MAX_ROWS == 1
    assert panel_max_rows(torch.bfloat16, bf16_only, amx_panels=False) == MAX_ROWS
    assert panel_max_rows(torch.float32, amx, amx_panels=True) == MAX_ROWS
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    model = nn.Sequential(linear)
    kernel = load_cpu_kernel()
    if not kernel.panel_bf16:
        pytest.skip("this kernel build has no AVX512_BF16: no bfloat16 panels")
    assert use_panel_linears(model, torch.bfloat16, kernel, max_rows=1) == 1
    calls: list[int] = []
    model[0]._kernel = CountingKernel(kernel, calls)
    with torch.inference_mode():
        for rows in (1, 2, 64):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            if rows > 1:  # the fallback itself
                assert torch.equal(model(x), linear(x))
            else:
                assert_close_to_f_linear(model(x), x, linear.weight)
    assert calls == [1]


def test_the_kernel_says_whether_it_multiplies_bfloat16_panels_on_amx_tiles():
    kernel = load_cpu_kernel()
    assert isinstance(kernel.panel_amx, bool)
    assert not kernel.panel_amx or (kernel.panel_bf16 and kernel.amx_tiles)
    for isa in host_runnable_isas():  # the fixed levels carry no AMX
        assert isa == "native" or not load_cpu_kernel(isa).panel_amx


@pytest.mark.parametrize("isa", BF16_KERNELS)
def test_bfloat16_layers_with_a_bias_or_odd_in_features_are_left_alone(isa):
    model = nn.Sequential(
        nn.Linear(64, 40), nn.Linear(40, 33, bias=False), nn.Linear(33, 8, bias=False)
    )
    model = model.to(torch.bfloat16)
    assert use_panel_linears(model, torch.bfloat16, load_cpu_kernel(isa)) == 1
    assert [type(m).__name__ for m in model] == ["Linear", "PanelLinear", "Linear"]
