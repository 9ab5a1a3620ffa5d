"""RMSNorm on CPU in one C++ pass (cache/attention/csrc/rms_norm.cpp) instead of seven ops, for
float32 and bfloat16 models.

Hugging Face's `LlamaRMSNorm.forward` upcasts, squares, averages, adds eps, takes rsqrt,
multiplies and downcasts, then multiplies by the weight: seven passes over the activations, each
with its own allocation and op dispatch, 61 times a forward pass of the default model. The C++
op reads each row once for its sum of squares and once more to write, rounding to the model's
dtype at the two places the module does. Measured on the fixed workload (64 requests, bfloat16, two
threads, Sapphire Rapids, A/B/A/B/A/B in fresh processes): 2.3% less wall time end to end (4%
with prefix caching off); 4-5x faster per call (9 us vs 45 us at 64 rows, 0.23 ms vs 0.92 ms at
2,048 rows). In the float32 workload on a 2-core Zen 4 the module took 0.38 ms a call at 512
rows and 0.14 ms at 64 (1.7 s of a ~60 s run; benchmarks/RESULTS.md, "Fifteenth session").

Not bit-identical: the op sums the squares in double (nearly exact) where ATen's mean sums float32
in its own order, so 1 / rms can differ in its last bits. In float32 a row's elements then move by a
few ulps (at most 3 on random rows), as the linears' own sums in another order (oneDNN's, the skinny
kernel's) already move them; in bfloat16 an element whose scaled value sits on a rounding boundary
can round the other way (one ulp, a few elements in 10,000). On the default model the fused bfloat16
logits are as close to the float32 model's as the module's are (mean absolute error 0.087-0.105
either way over 8 real prompts, top-1 agreement the same or higher), and the float32 model with
every fused op still gives Hugging Face's greedy tokens (tests/engine/test_greedy_equality.py). So
it is swapped only where that is all it changes:
- a module whose class's `forward` is, to the character, `LlamaRMSNorm.forward` (Llama, Mistral,
  Qwen2/3, Phi-3, Granite, SmolLM3 copy it; Gemma's `1 + weight` and Olmo2's order differ and are
  left alone);
- float32 or bfloat16 CPU models;
- and only if the op agrees with the module on a probe input to FUSED_TOLERANCE_EPS (two
  bfloat16 ulps, eight float32 ones; engine/module_swap.py).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.engine.module_swap import (
    cpu_kernel_or_none,
    fusable_dtype,
    has_forward_of,
    is_fusable_cpu_model,
    swap_verified,
    within_fused_tolerance,
)


def computes_llama_rms_norm(cls: type) -> bool:
    """Whether `cls.forward` is Hugging Face's LlamaRMSNorm formula, word for word."""
    return has_forward_of(cls, LlamaRMSNorm)


class FusedRMSNorm(nn.Module):
    """A Llama-style RMSNorm module whose forward is one C++ call; same weight."""

    def __init__(self, norm: nn.Module, kernel: ModuleType) -> None:
        super().__init__()
        self.weight = norm.weight  # the same Parameter: the state dict is unchanged
        self.variance_epsilon = float(norm.variance_epsilon)
        self._kernel = kernel

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self._kernel.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused=C++"


def can_fuse_norms(model: nn.Module) -> bool:
    """float32 and bfloat16 CPU models."""
    return is_fusable_cpu_model(model)


def fuse_rms_norms(model: nn.Module, kernel: ModuleType | None = None) -> int:
    """Swap each eligible RMSNorm of a CPU model for a `FusedRMSNorm`; returns how many.

    `kernel` defaults to the host's CPU extension build (built on first use); if it cannot be
    built the model keeps its modules, with a warning.
    """
    kernel = kernel or cpu_kernel_or_none("RMSNorm left unfused")
    dtype = fusable_dtype(model)
    if kernel is None or dtype is None:
        return 0

    def fused(child: nn.Module) -> FusedRMSNorm | None:
        if not computes_llama_rms_norm(type(child)) or child.weight.dtype != dtype:
            return None
        return FusedRMSNorm(child, kernel)

    return swap_verified(model, fused, _same_output, "the fused RMSNorm")


@torch.inference_mode()
def _same_output(norm: nn.Module, fused: FusedRMSNorm) -> bool:
    """Within FUSED_TOLERANCE_EPS of the module on a probe input (a different formula is not)."""
    size = norm.weight.shape[0]
    probe = torch.randn(4, size, generator=torch.Generator().manual_seed(0))
    probe = probe.to(norm.weight.dtype)
    return within_fused_tolerance(fused(probe), norm(probe))
