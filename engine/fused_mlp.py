"""Llama-style MLP on CPU: one matrix multiply for gate and up, then SiLU-and-multiply in one C++
pass (cache/attention/csrc/silu_mul.cpp), then down; for float32 and bfloat16 models.

Hugging Face's `LlamaMLP.forward` is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: two matrix
multiplies over the same input, a SiLU pass and a multiply pass, each with its own allocation and
op dispatch, once per layer. `FusedMLP` multiplies by the concatenated `[gate; up]` weight (built
once at load, then packed for oneDNN like every other linear) and reads that output once for
`silu(gate) * up`. Measured (30 layers of the default model's shapes, two threads, Sapphire
Rapids): 0.88x / 0.91x / 0.89x / 0.98x the time per MLP at 1 / 8 / 64 / 512 rows in bfloat16; end
to end that is inside the machine's noise (`benchmarks/RESULTS.md`). In the float32 workload on a
2-core Zen 4, SiLU and the multiply took 0.79 and 0.85 ms a call at 512 rows (2.4 s of 60 s in a
profiled run of 79 s; "Fifteenth session").

In bfloat16 the SiLU-and-multiply is bit-identical to the module's (checked on every bfloat16 gate
value); in float32 it is within a few ulps (ATen's exp is SLEEF's, this one a polynomial of its
own). The one matmul over `[gate; up]` is bit-identical to the two up to 512 rows in bfloat16, but
oneDNN may block a larger one differently (it did at 2,048 rows: an ulp here and there), as any
float32 sum in another order does. So it is swapped only where that is all it changes, as
engine/fused_norm.py does:
- a module whose class's `forward` is, to the character, `LlamaMLP.forward` (Mistral, Qwen2/3,
  Granite and others copy it) and whose activation is SiLU;
- float32 or bfloat16 CPU models;
- and only if, on a probe input, the fused intermediate agrees with the module's to
  FUSED_TOLERANCE_EPS (two bfloat16 ulps, eight float32 ones; engine/module_swap.py).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaMLP

from pagedserve.engine.module_swap import (
    concatenated_linear,
    concatenation_agrees,
    cpu_kernel_or_none,
    fusable_dtype,
    has_forward_of,
    is_fusable_cpu_model,
    swap_verified,
    within_fused_tolerance,
)


def computes_llama_mlp(cls: type) -> bool:
    """Whether `cls.forward` is Hugging Face's LlamaMLP formula, word for word."""
    return has_forward_of(cls, LlamaMLP)


def _is_silu(activation: nn.Module) -> bool:
    probe = torch.linspace(-12.0, 12.0, 97)
    return bool(torch.allclose(activation(probe), nn.functional.silu(probe)))


class FusedMLP(nn.Module):
    """A Llama-style MLP whose gate and up projections are one linear layer."""

    def __init__(self, mlp: nn.Module, kernel: ModuleType) -> None:
        super().__init__()
        # Rows [0, I) of its output compute gate, rows [I, 2I) up.
        self.gate_up_proj = concatenated_linear([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self._kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self._kernel.silu_mul(self.gate_up_proj(x)))

    def extra_repr(self) -> str:
        return "silu(gate) * up fused=C++"


def can_fuse_mlps(model: nn.Module) -> bool:
    """float32 and bfloat16 CPU models."""
    return is_fusable_cpu_model(model)


def fuse_mlps(model: nn.Module, kernel: ModuleType | None = None) -> int:
    """Swap each eligible MLP of a CPU model for a `FusedMLP`; returns how many.

    Run before `pack_linears`, which then packs the concatenated weight. `kernel` defaults to the
    host's CPU extension build; if it cannot be built the model keeps its modules, with a warning.
    """
    kernel = kernel or cpu_kernel_or_none("MLP left unfused")
    dtype = fusable_dtype(model)
    if kernel is None or dtype is None:
        return 0

    def fused(child: nn.Module) -> FusedMLP | None:
        if not computes_llama_mlp(type(child)) or not _is_silu(child.act_fn):
            return None
        if child.gate_proj.weight.dtype != dtype:
            return None
        return FusedMLP(child, kernel)

    return swap_verified(model, fused, _same_intermediate, "the fused MLP")


@torch.inference_mode()
def _same_intermediate(mlp: nn.Module, fused: FusedMLP) -> bool:
    """On a probe input: the [gate; up] matmul is the module's two (bit for bit in bfloat16, within
    float32 rounding in float32), and `silu(gate) * up` of it is within FUSED_TOLERANCE_EPS of
    the module's act_fn(gate) * up."""
    if not concatenation_agrees(fused.gate_up_proj, [mlp.gate_proj, mlp.up_proj], rows=4):
        return False
    probe = torch.randn(4, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(0))
    gate_up = fused.gate_up_proj(probe.to(mlp.gate_proj.weight.dtype))
    gate, up = gate_up.chunk(2, dim=-1)
    return within_fused_tolerance(fused._kernel.silu_mul(gate_up), mlp.act_fn(gate) * up)
