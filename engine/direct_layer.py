"""Llama-style decoder layers whose steps over the paged cache call the C++ kernels directly.

Between the kernels of a decode step, each layer ran Hugging Face's layer forward, about ten
`nn.Module` calls, the attention interface (its lookup, q/k/v transposed into [batch, heads,
tokens, head_dim] and back, the cache-group check, the backend's dtype checks) and the
projections' wrappers. `DirectDecoderLayer` makes the same calls itself: RMSNorm, the [q; k; v]
projection, RoPE, the K/V store, paged attention, o_proj, the residual add, RMSNorm, the MLP, the
residual add, every tensor a [tokens, hidden] view of the one before, its submodules called
through their `forward` (pagedserve installs no module hooks). Measured on the fixed workload's
decode steps (batch 64, the default model, 2-core AMD EPYC Zen 4; /tmp harness, direct and module
paths in shuffled rounds in one process): bfloat16 80.6 -> 78.4 ms a step (paired median 2.6 ms),
float32 144.6 -> 141.9 ms (4.1 ms).

The same modules and kernels run in the same order, so the outputs are the module path's bit
for bit (tests/engine/test_direct_layer.py). Where a call is not the plain case (no paged context,
MLA, kept rows, a backend other than the CPU kernel, K/V the store would convert to another cache
dtype, training mode), the layer runs Hugging Face's forward of
its original class on the same submodules.

Swapped where that is all it changes:
- a layer whose class's `forward` is, to the character, `LlamaDecoderLayer.forward` (so not the
  last layer where it computes only the kept rows, engine/kept_rows.py);
- whose norms are `FusedRMSNorm`, attention `FusedAttention` and MLP `FusedMLP` (each verified
  against the module it replaced when it was swapped in), with a head the kernel takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor, nn

from pagedserve.cache.attention.cpu import KERNEL_QUERY_DTYPES, MAX_HEAD_DIM, CpuPagedAttention
from pagedserve.engine.fused_attention import FusedAttention
from pagedserve.engine.fused_mlp import FusedMLP
from pagedserve.engine.fused_norm import FusedRMSNorm
from pagedserve.engine.kept_rows import computes_llama_decoder_layer
from pagedserve.engine.module_swap import adopt_layer, is_fusable_cpu_model, swap_children

if TYPE_CHECKING:
    from pagedserve.engine.model_runner import PagedContext


class DirectDecoderLayer(nn.Module):
    """A Llama-style decoder layer that calls the kernels itself in plain paged steps. Same
    submodules under the same names (the state dict is unchanged) and the same plain attributes
    (models read e.g. `attention_type` off their layers)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        adopt_layer(self, layer)
        # Hugging Face's forward of the original class, for every other call. The class wraps it
        # for gradient checkpointing (GradientCheckpointingLayer), a wrapper that reads training
        # attributes this module lacks: the function it wraps is taken.
        forward = type(layer).forward
        self._module_forward: Callable[..., Tensor] = getattr(forward, "__wrapped__", forward)

    def forward(self, hidden_states: Tensor, *args: object, **kwargs: object) -> Tensor:
        context = kwargs.get("paged_context")
        embeddings = kwargs.get("position_embeddings")
        if args or embeddings is None or not self._is_plain(hidden_states, context):
            return self._module_forward(self, hidden_states, *args, **kwargs)
        return self._direct(hidden_states, *embeddings, context)

    def _is_plain(self, hidden_states: Tensor, context: PagedContext | None) -> bool:
        """Whether the module path would store and attend through the CPU kernel as it is."""
        if context is None or context.is_latent or context.query_metas is not None:
            return False
        attention = self.self_attn
        key_cache = context.key_caches[attention.layer_idx]
        return (
            isinstance(context.backend, CpuPagedAttention)
            and hidden_states.dtype in KERNEL_QUERY_DTYPES
            and key_cache.dtype == hidden_states.dtype
            and not self.training
        )

    def _direct(
        self, hidden_states: Tensor, cos: Tensor, sin: Tensor, context: PagedContext
    ) -> Tensor:
        attention, kernel = self.self_attn, context.backend.kernel
        layer, head_dim = attention.layer_idx, attention.head_dim
        # As paged_attention_forward: the layer's cache group, checked against its (absent) window
        meta = context.metas[context.group_for(layer, None)]
        key_cache, value_cache = context.key_caches[layer], context.value_caches[layer]
        residual = hidden_states.view(-1, hidden_states.shape[-1])  # [tokens, hidden]
        tokens = residual.shape[0]
        qkv = attention.qkv_proj.forward(self.input_layernorm.forward(residual))
        attention.rotate(qkv, cos, sin)
        query, key, value = (
            part.view(tokens, -1, head_dim) for part in qkv.split(attention.split_sizes, dim=-1)
        )
        kernel.store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        scale = attention.scaling if attention.scaling is not None else head_dim**-0.5
        attended = kernel.paged_attention(
            query, key_cache, value_cache, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, scale, 0, 0.0, None,
        )  # fmt: skip
        hidden = residual + attention.o_proj.forward(attended.view(tokens, -1))
        hidden = hidden + self.mlp.forward(self.post_attention_layernorm.forward(hidden))
        return hidden.view_as(hidden_states)

    def extra_repr(self) -> str:
        return "kernels called directly in plain paged steps"


def can_use_direct_layers(model: nn.Module) -> bool:
    """float32 and bfloat16 CPU models (those the fused modules it builds on apply to)."""
    return is_fusable_cpu_model(model)


def use_direct_layers(model: nn.Module) -> int:
    """Swap each eligible decoder layer for a `DirectDecoderLayer`; returns how many. Run after the
    norm, attention and MLP swaps (fused_norm.py, fused_attention.py, fused_mlp.py)."""

    def direct(name: str, child: nn.Module) -> nn.Module | None:
        return DirectDecoderLayer(child) if _eligible(child) else None

    return swap_children(model, direct)


def _eligible(layer: nn.Module) -> bool:
    """Llama's formula over the fused modules, with a head the kernel takes."""
    return (
        computes_llama_decoder_layer(type(layer))
        and all(isinstance(getattr(layer, name, None), kind) for name, kind in _SUBMODULES.items())
        and layer.self_attn.head_dim <= MAX_HEAD_DIM
    )


_SUBMODULES = {
    "input_layernorm": FusedRMSNorm,
    "self_attn": FusedAttention,
    "post_attention_layernorm": FusedRMSNorm,
    "mlp": FusedMLP,
}
