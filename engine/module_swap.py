"""Replace submodules of a loaded Hugging Face model in place (the model classes stay HF's), and
the checks every such swap makes: which models it applies to, whether a module computes the
formula a replacement was written for, and the CPU extension the replacements call."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

logger = logging.getLogger(__name__)


def is_cpu_model(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the model's (first) parameters are `dtype` on the CPU: where a swap applies."""
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu" and parameter.dtype == dtype


def is_bfloat16_cpu_model(model: nn.Module) -> bool:
    return is_cpu_model(model, torch.bfloat16)


# The dtypes the fused C++ ops (RMSNorm, SiLU-and-mul, RoPE) compute, rounding where HF rounds.
FUSED_DTYPES = (torch.float32, torch.bfloat16)
# How far a fused op's output may be from the module's, relative, in units of the dtype's eps
# (the spacing of values in [1, 2), so N eps is N to 2N ulps of a value). bfloat16: one flipped
# rounding, one more from the multiply after it. float32: a sum (RMSNorm's) or an exp (SiLU's) in
# another order or to another last bit, carried through two or three roundings after it; a
# different formula is off by far more.
FUSED_TOLERANCE_EPS = {torch.bfloat16: 2, torch.float32: 8}


def is_fusable_cpu_model(model: nn.Module) -> bool:
    """Whether the model's (first) parameters are on the CPU in a dtype the fused ops compute."""
    return fusable_dtype(model) is not None


def fusable_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a fused module of this model computes in: its (first) parameters' on the CPU,
    where that is one of FUSED_DTYPES (a module kept in another dtype, e.g. a float32 norm in a
    bfloat16 model, is left alone: the op takes one dtype for input and weight)."""
    return next((dtype for dtype in FUSED_DTYPES if is_cpu_model(model, dtype)), None)


@torch.inference_mode()
def concatenation_agrees(concatenated: nn.Linear, parts: list[nn.Module], rows: int) -> bool:
    """Whether `concatenated` computes `parts`' outputs side by side on a `rows`-row probe: bit for
    bit in bfloat16, within float32 rounding in float32 (its sums may run in another order)."""

    def side_by_side(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in parts], dim=-1)

    if concatenated.weight.dtype == torch.float32:
        return within_float32_rounding(concatenated, side_by_side, rows)
    probe = torch.randn(rows, concatenated.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(concatenated.weight.dtype)
    return torch.equal(concatenated(probe), side_by_side(probe))


def within_fused_tolerance(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether a fused op's output is the module's up to FUSED_TOLERANCE_EPS, element by element."""
    eps = torch.finfo(expected.dtype).eps * FUSED_TOLERANCE_EPS[expected.dtype]
    got, expected = got.float(), expected.float()
    return bool(((got - expected).abs() <= eps * expected.abs()).all())


@functools.cache
def has_forward_of(cls: type, reference: type) -> bool:
    """Whether `cls.forward` is, to the character, `reference.forward` (so it computes the formula
    a replacement for `reference` was written and checked against)."""
    try:
        return inspect.getsource(cls.forward) == inspect.getsource(reference.forward)
    except (OSError, TypeError):  # no source to compare: not ours to replace
        return False


def cpu_kernel_or_none(purpose: str) -> ModuleType | None:
    """The host's CPU extension build (built on first use), or None with a warning if it cannot
    be built: a model without its swaps is slower, never wrong."""
    from pagedserve.cache.attention.cpu import load_cpu_kernel

    try:
        return load_cpu_kernel()
    except RuntimeError as error:  # no compiler, or the build failed
        logger.warning("%s: %s", purpose, error)
        return None


def tied_to_other_modules(model: nn.Module) -> set[int]:
    """Ids of the parameters that modules other than `nn.Linear` own (tied embeddings): a swap of
    a linear keeps such a weight reachable rather than dropping it."""
    return {
        id(parameter)
        for module in model.modules()
        if type(module) is not nn.Linear
        for parameter in module.parameters(recurse=False)
    }


@torch.inference_mode()
def within_float32_rounding(
    linear: nn.Linear, replacement: Callable[[torch.Tensor], torch.Tensor], rows: int
) -> bool:
    """Whether `replacement` computes `linear` on a `rows`-row probe up to float32 rounding: its
    sums of `in_features` products in another order, a few ulps of the summed magnitudes. For a
    bfloat16 layer, also one bfloat16 rounding of each output (a sum on a rounding boundary may
    round the other way)."""
    probe = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(linear.weight.dtype)
    expected, got = linear(probe).float(), replacement(probe).float()
    scale = probe.float().abs() @ linear.weight.float().abs().T
    if linear.bias is not None:
        scale = scale + linear.bias.float().abs()
    bound = 1e-5 * scale + 1e-30
    if linear.weight.dtype == torch.bfloat16:
        bound = bound + torch.finfo(torch.bfloat16).eps * expected.abs()
    return bool(((got - expected).abs() <= bound).all())


def swap_verified(
    model: nn.Module,
    replacement_for: Callable[[nn.Module], nn.Module | None],
    agrees: Callable[[nn.Module, nn.Module], bool],
    what: str,
) -> int:
    """Swap each submodule for `replacement_for(submodule)` (None: not eligible) where
    `agrees(original, replacement)` holds on a probe; returns how many. A replacement that
    disagrees is logged and the original kept: a swap may make a model faster, never different
    beyond rounding."""

    def replace(name: str, child: nn.Module) -> nn.Module | None:
        replacement = replacement_for(child)
        if replacement is None:
            return None
        if not agrees(child, replacement):
            logger.warning("%s disagrees with %s; left as it is", what, name)
            return None
        return replacement

    return swap_children(model, replace)


def adopt_layer(target: nn.Module, layer: nn.Module) -> None:
    """Give `target`, a module standing in for `layer`, its plain attributes (models read e.g.
    `attention_type` off their layers), training mode and submodules in their order (the same
    state dict)."""
    for name, value in vars(layer).items():
        if not name.startswith("_") and name != "training":
            setattr(target, name, value)
    for name, child in layer.named_children():
        setattr(target, name, child)
    target.train(layer.training)


def swap_children(model: nn.Module, replace: Callable[[str, nn.Module], nn.Module | None]) -> int:
    """Set each submodule to `replace(name, submodule)` where that is not None; returns how many.

    `replace` sees every submodule once, by its attribute name in its parent.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = replace(name, child)
            if replacement is not None:
                setattr(parent, name, replacement)
                swapped += 1
    return swapped


def concatenated_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing `linears`' outputs side by side (their weights stacked along the
    output dimension, biases too): one matrix multiply where a module ran several over one input."""
    first = linears[0]
    out_features = sum(linear.out_features for linear in linears)
    has_bias = first.bias is not None
    fused = nn.Linear(  # on "meta": no throwaway weight is allocated
        first.in_features, out_features, bias=has_bias, device="meta"
    )
    with torch.no_grad():
        fused.weight = nn.Parameter(
            torch.cat([linear.weight for linear in linears]), requires_grad=False
        )
        if has_bias:
            fused.bias = nn.Parameter(
                torch.cat([linear.bias for linear in linears]), requires_grad=False
            )
    return fused
