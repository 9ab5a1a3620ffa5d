"""float32 CPU linears at decode-sized batches through the C++ kernel in
cache/attention/csrc/skinny_linear.cpp, everything else through `F.linear` or oneDNN as before.

Which layers, by host:
- MKL's float32 (`--cpu-float32-linear mkl`): the LM head only, at 2-12 rows.
- oneDNN's packed float32 (x86 CPUs with AVX2): every linear, at 1-16 rows; the rest of each
  layer's batches through its packed copy.

At decode time a linear multiplies a handful of rows (one per sequence) by its weight, so it
should cost what reading that weight costs. Cold weights (30 copies of each layer, 2 of the head),
two threads, interleaved (`python -m pagedserve.benchmarks.linear --dtype float32`: the host's
float32 linear against the kernel on the default model's shapes):
- The head (49,152 x 576 floats, 113 MB, a fifth of the default model's weights). MKL: 4.2 ms at
  one row, but 8.9 / 14.7 / 21.8 ms for 4 / 8 / 12 rows, against the kernel's 6.0 / 8.2 / 10.4
  (Sapphire Rapids). With the kernel prefetching its weight into L2, a 2-core Zen 4: 4.2 / 4.3 /
  4.8 / 7.1 ms at 1 / 4 / 8 / 12 rows, oneDNN 6.3 / 5.0 / 5.9 / 6.7.
- Every layer on a 2-core Zen 3 (AVX2 only), where oneDNN streams these small weights at 4-13
  GB/s and the kernel at 10-21 (read pass 23): 1.4-2.6x at 1-8 rows (q/o 576x576 160 -> 87 us,
  gate/up 1536x576 285 -> 209 us at one row), 1.1-1.8x at 12-16, the head 1.06-1.2x. A batch-1
  decode step's linears: 46 -> 31 ms.
- Every layer on a 2-core Intel Sapphire Rapids (AVX-512), the 30 layers' q/k/v/o, gate/up and
  down (`/tmp` micro-benchmark, interleaved): 27.7 / 29.6 / 47.2 ms at 1 / 8 / 16 rows, against
  MKL's 28.6 / 50.7 / 71.4 and oneDNN's 40.0 / 42.1 / 56.3.
- Every layer on a 2-core AMD Zen 4 (AVX-512 with AVX512_BF16): 1.3-2.5x oneDNN at 1-8 rows
  (q/o 93 -> 56 us, gate/up 255 -> 118 us, down 216 -> 106 us at one row), 0.95-1.9x at 12-16, the
  head 1.1-1.4x at 1-8 and 0.85x at 12-16. Decode steps of the default model (256-token prompts,
  two alternating rounds of `benchmarks/step.py`): 44-48 -> 31-33 ms at batch 1, 49-54 -> 31-35 at
  4, 51-70 -> 44 at 8, 80-82 -> 73-75 at 16. The head-only rule this replaced (AMD's AVX-512 CPUs
  had not been measured) kept float32 serving 1.67x slower per output token than vLLM's there.

The kernel sums in another order than MKL or oneDNN (float32 rounding apart), and each row's result
does not depend on the other rows. Upstream of the head such a difference reaches the K/V cache,
where an fp8 cache's 3-bit mantissa can flip a rounding; tests/engine/test_kv_cache_dtype.py checks
fp8 tokens by teacher forcing for that reason (it failed free-running with the kernel on every
linear, as it did with MKL's and oneDNN's own batch-dependent rows). The modules keep the same
weight Parameter (a tied head stays tied, the state dict is unchanged); where they fall back to
oneDNN, that packed copy is extra memory, logged at load.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.cache.attention.cpu_features import host_cpu_flags
from pagedserve.engine.module_swap import (
    cpu_kernel_or_none,
    swap_verified,
    within_float32_rounding,
)
from pagedserve.engine.packed_linear import PackedLinear
from pagedserve.engine.widened_linear import WidenedLinear, computes_linears_in_float32

# The head's rows where the kernel is at least even with MKL (2 rows: 0.98x; 4-12: 1.5-2.1x). At
# one row MKL's GEMV is at the memory bound already, and at 16 its GEMM is as fast again (0.94x).
MIN_ROWS, MAX_ROWS = 2, 12
# Where the float32 linears run on oneDNN but only the head goes through the kernel (a caller's
# `every_layer=False`), the rows where the kernel beats oneDNN's packed head: 1.5x / 1.2x / 1.2x
# at 1 / 4 / 8 rows, even at 12 (the weight evicted before each call, two threads, Zen 4).
PACKED_ROWS = (1, 8)
# With packed linears, every layer's rows where the kernel beats oneDNN: all of them up to the
# kernel's limit on Zen 3 (1.1-1.8x at 12-16 rows), about even at 12-16 on Zen 4.
EVERY_LAYER_ROWS = (1, 16)


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
    """CPU models whose linears multiply in float32: float32 ones, and bfloat16 ones widened on a
    CPU without native bf16 (others pack their bfloat16 weights for oneDNN instead)."""
    return computes_linears_in_float32(model)


def use_skinny_linears(
    model: nn.Module,
    kernel: ModuleType | None = None,
    packed: bool = False,
    every_layer: bool | None = None,
) -> int:
    """Swap the LM head of a float32 CPU model (with `every_layer`, every `nn.Linear`) for a
    `SkinnyLinear`; returns how many were swapped.

    `packed`: the model's linears are about to be packed for oneDNN (`pack_linears`, which leaves
    swapped modules alone); each swapped layer then sends its decode-sized batches to the kernel
    and the rest to its own packed copy. `every_layer` applies only with `packed`; it defaults to
    the host having AVX2 (module docstring). `kernel` defaults to the host's CPU
    extension build; if it cannot be built the model keeps its linears, with a warning. A layer
    whose kernel output is not within float32 rounding of `F.linear` on a probe input is left as
    it is (and logged).
    """
    if every_layer is None:
        every_layer = packed and skinny_every_layer_on(host_cpu_flags())
    if every_layer and not packed:
        raise ValueError("every_layer needs packed: MKL's float32 layers are left as they are")
    targets = _float32_linears(model, every_layer)
    if not targets:
        return 0
    kernel = kernel or cpu_kernel_or_none("the float32 linears left as they are")
    if kernel is None:
        return 0

    def skinny(child: nn.Module) -> SkinnyLinear | None:
        if id(child) not in targets:
            return None
        if not packed:
            return SkinnyLinear(child, kernel)
        rows = EVERY_LAYER_ROWS if every_layer else PACKED_ROWS
        return SkinnyLinear(child, kernel, rows, PackedLinear(child, keep_weight=True))

    return swap_verified(model, skinny, _close_to_linear, "the skinny kernel")


def _float32_linears(model: nn.Module, every_layer: bool) -> set[int]:
    """Ids of the float32 `nn.Linear`s to swap: every one, or the LM head's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, WidenedLinear):  # a bfloat16 head that multiplies in float32
        head = head.inner
    candidates = [m for m in model.modules() if type(m) is nn.Linear] if every_layer else [head]
    return {id(m) for m in candidates if type(m) is nn.Linear and m.weight.dtype == torch.float32}


def skinny_every_layer_on(flags: frozenset[str]) -> bool:
    """Whether a CPU with these flags runs every packed float32 linear's decode-sized batches
    through the kernel: x86 with AVX2 (measured faster than oneDNN on AMD Zen 3 and Zen 4 and on
    Intel Sapphire Rapids)."""
    return "avx2" in flags


def _close_to_linear(linear: nn.Linear, skinny: SkinnyLinear) -> bool:
    return within_float32_rounding(linear, skinny, skinny.max_rows)  # rows the kernel computes
