"""Llama-style attention on CPU: one matrix multiply for Q, K and V, and the rotary embedding in
one C++ pass (cache/attention/csrc/rope.cpp) over the q and k heads of its output; for float32
and bfloat16 models.

Hugging Face's `LlamaAttention.forward` projects q, k and v by three matrix multiplies, then
`apply_rotary_pos_emb` rotates q and k with ten element-wise ops (two slices, negations,
concatenations and adds, four multiplies), each a new tensor, in every layer: in a profile of the
default model's bfloat16 workload (64 requests) they took about 1.5 s of 19 s of operator time,
in the float32 one 5.6 s of 60 s (a profiled run of 79 s, 2-core Zen 4). `FusedAttention`
multiplies by the concatenated [q; k; v] weight (built once at load, then packed for oneDNN like
every other linear) and rotates q and k in place in that output; from there on it is the module's
own forward: the attention interface (pagedserve's paged attention), then o_proj. The rotation
rounds where the module's ops do (bit-identical in both dtypes, checked on every swap); the one
matmul over [q; k; v] gives the three's bits below 512 rows in bfloat16, while from 512 rows
oneDNN blocks it differently and an ulp flips here and there (3 in 100,000 values), as for
fused_mlp, and float32 sums may come out in another order (within float32 rounding, checked on
every swap).

Measured (30 layers of the default model's projections and rotation, packed for oneDNN, two
threads, Sapphire Rapids, interleaved): 23.1 -> 13.9 ms at 64 rows, 81.6 -> 42.3 ms at 512 in
bfloat16. On the whole 64-request workload that is ~2.7 s of ~32, inside that VM's run-to-run
noise.

Swapped only where that is all it changes, as engine/fused_mlp.py does:
- a module whose class's `forward` is, to the character, `LlamaAttention.forward` (Gemma, Granite
  and others copy it; Mistral's and Qwen2's pass a sliding window on, Qwen3's normalises q and k:
  not eligible);
- float32 or bfloat16 CPU models;
- and only if, on a probe input (5 rows), the rotation of the fused projection is the module's
  `apply_rotary_pos_emb` bit for bit, and the fused projection is the three's (bit for bit in
  bfloat16, within float32 rounding in float32).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from pagedserve.engine.module_swap import (
    concatenated_linear,
    concatenation_agrees,
    cpu_kernel_or_none,
    fusable_dtype,
    has_forward_of,
    is_fusable_cpu_model,
    swap_verified,
)


def computes_llama_attention(cls: type) -> bool:
    """Whether `cls.forward` is Hugging Face's LlamaAttention formula, word for word."""
    return has_forward_of(cls, LlamaAttention)


class FusedAttention(nn.Module):
    """A Llama-style attention whose q, k and v projections are one linear layer, rotated in C++.

    It keeps the attributes attention interfaces read from their module (layer_idx, scaling,
    is_causal, num_key_value_groups, config)."""

    def __init__(self, attention: nn.Module, kernel: ModuleType) -> None:
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.num_key_value_groups = attention.num_key_value_groups
        self.scaling = attention.scaling
        self.attention_dropout = attention.attention_dropout
        self.is_causal = attention.is_causal
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.split_sizes = [projection.out_features for projection in projections]
        self.rotated_heads = (self.split_sizes[0] + self.split_sizes[1]) // self.head_dim
        self.qkv_proj = concatenated_linear(projections)
        self.o_proj = attention.o_proj
        self._kernel = kernel

    def rotate(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Rotate the q and k heads of a [q; k; v] projection's output in place."""
        self._kernel.rope_(
            qkv.view(-1, qkv.shape[-1]),
            cos.reshape(-1, self.head_dim),
            sin.reshape(-1, self.head_dim),
            self.rotated_heads,
            self.head_dim,
        )

    def rotated_qkv(self, hidden_states: Tensor, cos: Tensor, sin: Tensor) -> list[Tensor]:
        """q, k and v as the module has them before attention: [batch, heads, tokens, head_dim]
        views of one projection, q and k rotated."""
        qkv = self.qkv_proj(hidden_states)
        self.rotate(qkv, cos, sin)
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        return [
            part.view(hidden_shape).transpose(1, 2) for part in qkv.split(self.split_sizes, dim=-1)
        ]

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        cache: object | None = None,
        query_rows: Tensor | None = None,
        **kwargs: object,
    ) -> tuple[Tensor, Tensor | None]:
        """The module's forward; with `query_rows` (engine/kept_rows.py), every row's K/V still
        reach the attention interface, but only those rows are queries and outputs."""
        input_shape = hidden_states.shape[:-1]
        query, key, value = self.rotated_qkv(hidden_states, *position_embeddings)
        if query_rows is not None:
            query = query.index_select(2, query_rows)
            input_shape = (*input_shape[:-1], query_rows.numel())
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        output = output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(output), weights

    def extra_repr(self) -> str:
        return "q/k/v fused, rotary=C++"


def can_fuse_attention(model: nn.Module) -> bool:
    """float32 and bfloat16 CPU models."""
    return is_fusable_cpu_model(model)


def fuse_attention(model: nn.Module, kernel: ModuleType | None = None) -> int:
    """Swap each eligible attention module of a CPU model for a `FusedAttention`;
    returns how many.

    Run before `pack_linears`, which then packs the concatenated weight. `kernel` defaults to the
    host's CPU extension build; if it cannot be built the model keeps its modules, with a warning.
    """
    kernel = kernel or cpu_kernel_or_none("attention left unfused")
    dtype = fusable_dtype(model)
    if kernel is None or dtype is None:
        return 0

    def fused(child: nn.Module) -> FusedAttention | None:
        if not computes_llama_attention(type(child)) or child.head_dim % 2:
            return None
        if child.q_proj.weight.dtype != dtype:
            return None
        return FusedAttention(child, kernel)

    return swap_verified(model, fused, _same_states, "the fused attention")


@torch.inference_mode()
def _same_states(attention: nn.Module, fused: FusedAttention) -> bool:
    """On a probe input: the fused projection is the module's three (bit for bit in bfloat16,
    within float32 rounding in float32), and its rotated q and k are `apply_rotary_pos_emb`'s of
    it, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    dtype = attention.q_proj.weight.dtype
    hidden = attention.q_proj.in_features
    probe = torch.randn(1, 5, hidden, generator=generator).to(dtype)
    cos, sin = (  # any angles: the rotation's arithmetic is what is checked
        torch.rand(1, 5, attention.head_dim, generator=generator).mul(2).sub(1).to(dtype)
        for _ in range(2)
    )
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    if not concatenation_agrees(fused.qkv_proj, projections, rows=5):
        return False
    shape = (1, 5, -1, attention.head_dim)
    q, k, v = (
        part.view(shape).transpose(1, 2)
        for part in fused.qkv_proj(probe).split(fused.split_sizes, dim=-1)
    )
    expected_states = [*apply_rotary_pos_emb(q, k, cos, sin), v]
    got = fused.rotated_qkv(probe, cos, sin)
    return all(torch.equal(a, b) for a, b in zip(got, expected_states, strict=True))
