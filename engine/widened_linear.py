"""bfloat16 linears on a CPU without native bf16 dot products (no AVX512_BF16, no AMX): computed in
float32 from a float32 copy of the weight, made once at load.

What a CPU with native bf16 computes for a bfloat16 linear (oneDNN's AVX512_BF16 and AMX kernels,
torch's own bf16 GEMM) is bf16 products summed in float32, the sum rounded to bf16 once. The
product of two bf16 numbers is exact in float32 (8 + 8 significant bits in 24), so a float32 GEMM
over the widened input and weight computes the same sums, only in its own order (as any two GEMMs
differ), and rounding its output to bf16 gives the bf16 result, to one bf16 ulp. Without native
bf16, torch's bf16 GEMM is the slow part of a bfloat16 model: each `WidenedLinear` hands its float32
copy to the host's float32 linear instead (MKL, or oneDNN's packed layout and the skinny kernel
where the loader picks them, as for a float32 model). Everything else (embeddings, norms,
activations, the K/V cache) stays bfloat16. Measured on a 2-core Zen 3 (AVX2 only), the default
model, one process, interleaved: 16 requests of 128 prompt + 32 output tokens 14.70 -> 4.36 s
(3.4x); one request 1.03x (at one row torch's bf16 GEMV was not the slow part).

The cost is memory: the float32 copy takes twice the bf16 weight (the bf16 weight is dropped unless
another module shares it, such as tied embeddings). The loader logs it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.cache.attention.cpu_features import host_cpu_flags, missing_native_bf16
from pagedserve.engine.module_swap import (
    is_bfloat16_cpu_model,
    is_cpu_model,
    swap_verified,
    tied_to_other_modules,
)


class WidenedLinear(nn.Module):
    """A bfloat16 `nn.Linear` computed by `inner`, a float32 linear over the exact float32 copy of
    its weight (the loader may swap `inner` for the host's float32 fast paths)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        inner = nn.Linear(  # on "meta": no throwaway weight is allocated
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta"
        )
        inner.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        if linear.bias is not None:
            inner.bias = nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.inner = inner
        if keep_weight:  # a weight tied to another module stays reachable here, as in HF
            self.weight = linear.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.to(torch.float32)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 in float32"


def can_widen_linears(model: nn.Module, flags: frozenset[str] | None = None) -> bool:
    """bfloat16 CPU models on a CPU (the host, or one with `flags`) without native bf16."""
    if not is_bfloat16_cpu_model(model):
        return False
    return bool(missing_native_bf16(host_cpu_flags() if flags is None else flags))


def computes_linears_in_float32(model: nn.Module) -> bool:
    """Whether the model's CPU linears multiply in float32: a float32 model, or a bfloat16 one
    whose linears were widened (the float32 fast paths apply to both)."""
    if is_cpu_model(model, torch.float32):
        return True
    return is_bfloat16_cpu_model(model) and any(
        isinstance(module, WidenedLinear) for module in model.modules()
    )


def widen_linears(model: nn.Module) -> int:
    """Swap every bfloat16 `nn.Linear` of the model for a `WidenedLinear`; returns how many. A
    layer whose output is not within one bf16 ulp of its own on a probe input is left as it is
    (and logged)."""
    tied = tied_to_other_modules(model)

    def widened(child: nn.Module) -> WidenedLinear | None:
        if type(child) is not nn.Linear or child.weight.dtype != torch.bfloat16:
            return None
        return WidenedLinear(child, keep_weight=id(child.weight) in tied)

    return swap_verified(model, widened, within_one_bfloat16_ulp, "the float32-computed linear")


def widened_weight_mib(model: nn.Module) -> float:
    """The float32 copies' memory."""
    return (
        sum(
            module.inner.weight.numel() * 4
            for module in model.modules()
            if isinstance(module, WidenedLinear)
        )
        / 2**20
    )


@torch.inference_mode()
def within_one_bfloat16_ulp(linear: nn.Linear, widened: nn.Module, rows: int = 8) -> bool:
    """Whether `widened` computes the bf16 `linear` on a probe to one bf16 ulp of each output (its
    float32 sums in another order can round to the neighbouring bf16 number)."""
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(rows, linear.in_features, generator=generator).to(torch.bfloat16)
    expected, got = linear(probe).float(), widened(probe).float()
    scale = probe.float().abs() @ linear.weight.float().abs().T  # float32 rounding of the sums
    return bool(((got - expected).abs() <= 2.0**-7 * expected.abs() + 1e-5 * scale).all())
