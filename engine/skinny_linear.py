"""The float32 LM head on CPU: decode-sized batches (2-12 rows) through the C++ kernel in
cache/attention/csrc/skinny_linear.cpp, everything else through `F.linear` as before; where the
float32 linears are packed for oneDNN (x86 CPUs MKL is slow on), 1-8 rows through the kernel and
the rest through the head's packed copy.

At decode time the head multiplies a handful of rows (one per sequence sampled) by the largest
matrix of a small model (49,152 x 576 floats, 113 MB, a fifth of the default model's weights), so
it should cost what reading that weight costs. MKL (behind `F.linear` in float32) manages that
for one row (4.2 ms), but its GEMM path took 8.9 / 14.7 / 21.8 ms for 4 / 8 / 12 rows; the kernel,
streaming the weight once for all the rows, 6.0 / 8.2 / 10.4 ms (1.5x / 1.8x / 2.1x; two threads,
Sapphire Rapids; `benchmarks/linear.py --dtype float32`). A decode step at batch 4-8 is ~5% faster.
Since the kernel prefetches its weight into L2: 4.2 / 4.3 / 4.8 / 7.1 ms at 1 / 4 / 8 / 12 rows on
a 2-core Zen 4, where oneDNN's packed head takes 6.3 / 5.0 / 5.9 / 6.7 ms.

The head only, on purpose. The kernel sums in another order than MKL (float32 rounding apart), and
upstream of the head such a difference reaches the K/V cache, where an fp8 cache's 3-bit mantissa
turns it into a different token (measured: tests/engine/test_kv_cache_dtype.py failed with the
kernel on every linear). Past the head only the argmax and the logprobs see it, as they see
batching, and the float32 greedy equality tests with Hugging Face's `generate` still hold. On the
other layers the kernel was at best 1.5x MKL (q/k/v/o at 4-8 rows) and even elsewhere. The module
keeps the same weight Parameter (a tied head stays tied, the state dict is unchanged).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.engine.module_swap import (
    cpu_kernel_or_none,
    is_cpu_model,
    swap_verified,
    within_float32_rounding,
)
from pagedserve.engine.packed_linear import PackedLinear

# The head's rows where the kernel is at least even with MKL (2 rows: 0.98x; 4-12: 1.5-2.1x). At
# one row MKL's GEMV is at the memory bound already, and at 16 its GEMM is as fast again (0.94x).
MIN_ROWS, MAX_ROWS = 2, 12
# Where the float32 linears run on oneDNN (packed_linear.py: x86 CPUs MKL is slow on), the rows
# where the kernel beats oneDNN's packed head: 1.5x / 1.2x / 1.2x at 1 / 4 / 8 rows, even at 12
# (the weight evicted before each call, two threads, Zen 4).
PACKED_ROWS = (1, 8)


class SkinnyLinear(nn.Module):
    """An LM head (`nn.Linear`) whose float32 forward at decode-sized batches (`rows`, both ends
    included) is the C++ skinny kernel; other batches go to `fallback` (default: `F.linear`)."""

    def __init__(
        self,
        linear: nn.Linear,
        kernel: ModuleType,
        rows: tuple[int, int] = (MIN_ROWS, MAX_ROWS),
        fallback: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties and the state dict unchanged
        self.bias = linear.bias
        self.min_rows, self.max_rows = rows
        self.fallback = fallback
        self._kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if not self.min_rows <= rows <= self.max_rows or x.dtype != torch.float32:
            if self.fallback is not None:
                return self.fallback(x)
            return F.linear(x, self.weight, self.bias)
        output = self._kernel.skinny_linear_fp32(x, self.weight)
        return output if self.bias is None else output + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"skinny=C++ at {self.min_rows}-{self.max_rows} rows"
        )


def can_use_skinny_linears(model: nn.Module) -> bool:
    """float32 CPU models (bfloat16 ones pack their weights for oneDNN instead)."""
    return is_cpu_model(model, torch.float32)


def use_skinny_linears(
    model: nn.Module, kernel: ModuleType | None = None, packed: bool = False
) -> int:
    """Swap the LM head of a float32 CPU model for a `SkinnyLinear`; returns 1 if it was, else 0.

    `packed`: the model's linears are about to be packed for oneDNN (`pack_linears`, which leaves
    the swapped head alone); the head then sends 1-8 rows to the kernel and the rest to its own
    packed copy. `kernel` defaults to the host's CPU extension build; if it cannot be built the
    model keeps its head, with a warning. A head whose kernel output is not within float32
    rounding of `F.linear` on a probe input is left as it is (and logged).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return 0
    kernel = kernel or cpu_kernel_or_none("the float32 LM head left as it is")
    if kernel is None:
        return 0

    def skinny(child: nn.Module) -> SkinnyLinear | None:
        if child is not head:
            return None
        if not packed:
            return SkinnyLinear(child, kernel)
        return SkinnyLinear(child, kernel, PACKED_ROWS, PackedLinear(child, keep_weight=True))

    return swap_verified(model, skinny, _close_to_linear, "the skinny kernel")


def _close_to_linear(linear: nn.Linear, skinny: SkinnyLinear) -> bool:
    return within_float32_rounding(linear, skinny, skinny.max_rows)  # rows the kernel computes
