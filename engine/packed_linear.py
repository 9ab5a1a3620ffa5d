"""CPU linear layers with their weights reordered once, at load, into oneDNN's layout.

bfloat16: `F.linear` on a bfloat16 CPU tensor hands oneDNN a plain row-major weight, which oneDNN
reorders into its blocked (AMX / AVX512_BF16) layout on every call. `PackedLinear` does that
reorder once and calls oneDNN's matmul on the packed weight: the same kernel, so the same bits,
without the per-call copy. Measured on the default model's shapes, one thread, Sapphire Rapids:
1.5-4.4x faster at decode sizes (1-64 rows), 1.2-1.5x at prefill sizes (300-512 rows), outputs
bit-identical (`benchmarks/linear.py`). Only on CPUs with native bf16 dot products: without
AVX512_BF16/AMX oneDNN emulates bf16.

float32: `F.linear` is MKL's GEMM, which picks its kernels by CPU vendor: on an AMD EPYC (Zen 5)
oneDNN ran the default model's linears 1.2-4.3x faster, even limited to AVX2 (the Zen 2 case). On
Intel's Sapphire Rapids the two are level at prefill sizes (0.98-1.03x at 256-512 rows), oneDNN is
1.1-1.6x faster at 16-64 rows (gate/up, down, q/o; k/v 0.8-0.9x) and MKL up to 1.9x faster at 1-2
rows, where the skinny kernel takes every layer's batches anyway (skinny_linear.py). So
`--cpu-float32-linear auto` packs float32 weights for oneDNN on every x86 CPU. oneDNN sums in
another order than MKL: outputs agree to float32 rounding, not to the bit (`mkl` keeps Hugging
Face's exact computation).

The model classes stay Hugging Face's: each `nn.Linear` is swapped for a module with the same call
signature.
"""

from __future__ import annotations

import platform

import torch
from torch import Tensor, nn

from pagedserve.cache.attention.cpu_features import (
    host_cpu_flags,
    host_cpu_vendor,
    missing_native_bf16,
)
from pagedserve.engine.module_swap import (
    is_bfloat16_cpu_model,
    swap_verified,
    tied_to_other_modules,
    within_float32_rounding,
)
from pagedserve.engine.widened_linear import computes_linears_in_float32

X86_MACHINES = ("x86_64", "AMD64")


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight lives in oneDNN's blocked layout (reordered once)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor: not part of the state dict, never moved between devices.
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias
        if keep_weight:  # a weight tied to another module stays reachable here, as in HF
            self.weight = linear.weight

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def can_pack(model: nn.Module, flags: frozenset[str] | None = None) -> bool:
    """Whether `pack_linears` applies to a bfloat16 model: on the CPU, a CPU with native bf16, and
    a torch build with oneDNN's bf16 linear."""
    if not is_bfloat16_cpu_model(model):
        return False
    if missing_native_bf16(host_cpu_flags() if flags is None else flags):
        return False
    return _has_onednn_linear() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def float32_linear_backend(
    setting: str, vendor: str | None = None, machine: str | None = None
) -> str:
    """The backend of float32 CPU linears, mkl or onednn: the setting, with `auto` resolved for
    the host (or the given CPU vendor id and machine): oneDNN on x86 CPUs whose vendor is known
    (module docstring; an unidentified CPU keeps torch's own path)."""
    if setting != "auto":
        return setting
    vendor = host_cpu_vendor() if vendor is None else vendor
    machine = platform.machine() if machine is None else machine
    return "onednn" if machine in X86_MACHINES and vendor else "mkl"


def can_pack_float32(model: nn.Module, setting: str = "auto") -> bool:
    """Whether `pack_linears` applies to a float32 model (or a bfloat16 one whose linears compute
    in float32, widened_linear.py): on the CPU, `setting` (the config's `cpu_float32_linear`)
    resolves to onednn, and torch has oneDNN's linear."""
    return (
        computes_linears_in_float32(model)
        and float32_linear_backend(setting) == "onednn"
        and _has_onednn_linear()
    )


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a bfloat16 or float32 CPU model for a `PackedLinear`; returns how
    many.

    A weight tied to another module (the LM head to the embeddings) stays that module's and stays
    reachable as the packed module's `weight` (no copy); the packed copy is the head's own. A
    layer whose packed output differs from `F.linear` on a probe input is left as it is (and
    logged): in bfloat16 by a single bit, in float32 by more than float32 rounding.
    """
    tied = tied_to_other_modules(model)

    def packed(child: nn.Module) -> PackedLinear | None:
        if type(child) is not nn.Linear:
            return None
        return PackedLinear(child, keep_weight=id(child.weight) in tied)

    def agrees(linear: nn.Linear, packed: PackedLinear) -> bool:
        if linear.weight.dtype == torch.bfloat16:
            return _same_output(linear, packed)
        return _within_rounding(linear, packed)

    return swap_verified(model, packed, agrees, "oneDNN's packed linear")


def _has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


@torch.inference_mode()
def _same_output(linear: nn.Linear, packed: PackedLinear) -> bool:
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(linear.weight.dtype)
    return torch.equal(linear(probe), packed(probe))


def _within_rounding(linear: nn.Linear, packed: PackedLinear) -> bool:
    return within_float32_rounding(linear, packed, rows=8)
