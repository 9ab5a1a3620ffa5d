"""bfloat16 linear layers on CPU with their weights reordered once, at load, into oneDNN's layout.

`F.linear` on a bfloat16 CPU tensor hands oneDNN a plain row-major weight, which oneDNN reorders
into its blocked (AMX / AVX512_BF16) layout on every call. `PackedLinear` does that reorder once
and calls oneDNN's matmul on the packed weight: the same kernel, so the same bits, without the
per-call copy. Measured on the default model's shapes, one thread, Sapphire Rapids: 1.5-4.4x
faster at decode sizes (1-64 rows), 1.2-1.5x at prefill sizes (300-512 rows), outputs
bit-identical (`benchmarks/linear.py`).

Only for bfloat16 on CPUs with native bf16 dot products: in float32 the packed path is not
faster at every size here and accumulates in another order (it would break token equality with
Hugging Face), and without AVX512_BF16/AMX oneDNN emulates bf16. The model classes stay Hugging
Face's: each `nn.Linear` is swapped for a module with the same call signature.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.cache.attention.cpu_features import host_cpu_flags, missing_native_bf16
from pagedserve.engine.module_swap import is_bfloat16_cpu_model, swap_verified


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
    """Whether `pack_linears` applies: a bfloat16 model on the CPU, a CPU with native bf16, and a
    torch build with oneDNN's bf16 linear."""
    if not is_bfloat16_cpu_model(model):
        return False
    if missing_native_bf16(host_cpu_flags() if flags is None else flags):
        return False
    return (
        torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a bfloat16 CPU model for a `PackedLinear`; returns how many.

    A weight tied to another module (the LM head to the embeddings) stays that module's and stays
    reachable as the packed module's `weight` (no copy); the packed copy is the head's own. A
    layer whose packed output differs from `F.linear` on a probe input is left as it is (and
    logged): the swap must not change a single bit.
    """
    tied = {  # parameters that other modules use too (tied embeddings)
        id(parameter)
        for module in model.modules()
        if type(module) is not nn.Linear
        for parameter in module.parameters(recurse=False)
    }

    def packed(child: nn.Module) -> PackedLinear | None:
        if type(child) is not nn.Linear:
            return None
        return PackedLinear(child, keep_weight=id(child.weight) in tied)

    return swap_verified(model, packed, _same_output, "oneDNN's packed linear")


@torch.inference_mode()
def _same_output(linear: nn.Linear, packed: PackedLinear) -> bool:
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(linear.weight.dtype)
    return torch.equal(linear(probe), packed(probe))
