"""The last decoder layer computes only the rows whose logits are kept.

A forward pass turns every scheduled token into a row, but logits are taken from a few of them:
each sampling sequence's last token (and its drafts' rows). Every layer but the last must still
compute every row, since the next layer's K/V come from it; the last layer's K/V come from its
*input*, so past its q/k/v projection only the kept rows matter. Hugging Face's `logits_to_keep`
already skips the other rows' final norm and LM head; this skips them one layer earlier: their
attention, o_proj, MLP and residual adds in the last decoder layer. In a prefill step of 2,048
tokens that finishes 6 prompts, that is 2,042 rows of 84% of a layer's matmul FLOPs (o_proj and
the MLP of the default model, against q/k/v), about 2.8% of the step's linears. Measured on the
fixed workload's prefill (64 prompts of 32-512 tokens in 2,048-token steps, prefix caching off;
the two ways interleaved in one process, shuffled, 4-5 rounds; 2-core AMD EPYC Zen 4, AVX-512 with
AVX512_BF16): float32 22.21 -> 21.70 s (2.3%), bfloat16 12.18 -> 11.61 s (4.9%). Decode steps keep
every row and are unchanged.

How: `ModelRunner.prepare` lists the kept rows (`logits_indices`, when they are each sequence's
last rows, a suffix of its chunk) and builds attention metadata for them alone: per sequence its
kept rows as the query, its context length and block table as they are. This layer then runs
input norm and q/k/v on every row (all K/V are stored, through the step's full metadata) and
everything after on the kept rows, in logits order, so the model's output has exactly the rows
the LM head needs. A step whose kept rows are all of its rows (a decode step), that has prompt-
logprob rows (any rows of a prompt, not a suffix), or that keeps none (a chunk in the middle of a
long prompt) runs the layer whole, as Hugging Face's forward.

The kept rows compute the same formula as in the whole layer; only their matmuls run with fewer
rows, which may pick another kernel (the panel kernel up to 128 rows) and so sum in another
order: float32 rounding (in bfloat16, an output on a rounding boundary may round the other way), as
any batch size already gives. Swapped where that is all it changes:
- the model's last decoder layer, whose class's `forward` is, to the character,
  `LlamaDecoderLayer.forward` (Mistral, Qwen2/3 and others copy it);
- whose attention is a `FusedAttention` (engine/fused_attention.py), which can attend with a
  subset of its rows as queries after storing every row's K/V.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from pagedserve.cache.attention import AttentionMetadata
from pagedserve.engine.fused_attention import FusedAttention
from pagedserve.engine.module_swap import adopt_layer, has_forward_of
from pagedserve.scheduler import SchedulerOutput


def computes_llama_decoder_layer(cls: type) -> bool:
    """Whether `cls.forward` is Hugging Face's LlamaDecoderLayer formula, word for word."""
    return has_forward_of(cls, LlamaDecoderLayer)


class KeptRowsDecoderLayer(nn.Module):
    """A Llama-style decoder layer that, given kept rows in its `paged_context`, returns only
    those rows. Same submodules under the same names (the state dict is unchanged) and the same
    plain attributes (models read e.g. `attention_type` off their layers)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        adopt_layer(self, layer)

    def forward(self, hidden_states: Tensor, **kwargs: object) -> Tensor:
        """`LlamaDecoderLayer.forward`'s formula; with kept rows in the context, from the attention
        on for those rows alone."""
        residual = hidden_states
        context = kwargs.get("paged_context")
        kept = getattr(context, "kept", None)
        if kept is not None:
            residual = hidden_states.index_select(1, kept.rows)
            kwargs["paged_context"] = dataclasses.replace(context, query_metas=kept.metas)
            kwargs["query_rows"] = kept.rows
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    def extra_repr(self) -> str:
        return "computes only the rows whose logits are kept"


def can_keep_rows(model: nn.Module) -> bool:
    """Whether the model's last decoder layer can be swapped (module docstring)."""
    layers = _decoder_layers(model)
    return bool(layers) and _eligible(layers[-1])


def keep_rows_in_last_layer(model: nn.Module) -> bool:
    """Swap the last decoder layer for a `KeptRowsDecoderLayer` where eligible; returns whether."""
    if not can_keep_rows(model):
        return False
    layers = _decoder_layers(model)
    layers[-1] = KeptRowsDecoderLayer(layers[-1])
    return True


def keeps_rows(model: nn.Module) -> bool:
    """Whether the model has a `KeptRowsDecoderLayer` (the runner then prepares kept rows)."""
    return any(isinstance(module, KeptRowsDecoderLayer) for module in model.modules())


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def _eligible(layer: nn.Module) -> bool:
    return computes_llama_decoder_layer(type(layer)) and isinstance(
        getattr(layer, "self_attn", None), FusedAttention
    )


@dataclasses.dataclass(frozen=True, slots=True)
class KeptRows:
    """The rows the last layer computes, in logits order, and attention metadata whose queries are
    exactly those rows (one group per cache group, as the step's own metadata)."""

    rows: Tensor  # [num_kept] int64, into the step's flattened tokens
    metas: tuple[AttentionMetadata, ...]


def kept_rows(
    plan: SchedulerOutput,
    logits_indices: Tensor,
    block_tables: list[list[list[int]]],
    device: torch.device,
) -> KeptRows | None:
    """The step's kept rows and their attention metadata, or None where the layer should run
    whole. `logits_indices`: the step's (the kept rows, in order). `block_tables`: per cache
    group, the step's padded block-table rows (one per sequence). Each kept sequence's query is
    its kept rows (the last ones of its chunk, so causality holds as it is), with its context
    length and block table as in the step; no slots, since the step's K/V are stored through its
    own metadata."""
    counts = _kept_counts(plan)
    if counts is None:
        return None

    def tensor(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    kept = [i for i, count in enumerate(counts) if count]
    query_start_loc = [0]
    for i in kept:
        query_start_loc.append(query_start_loc[-1] + counts[i])
    seq_lens = tensor([plan.requests[i].seq_len for i in kept], torch.int32)
    metas = tuple(
        AttentionMetadata(
            slot_mapping=tensor([], torch.int64),
            block_tables=tensor([tables[i] for i in kept], torch.int32),
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=seq_lens,
            max_query_len=max(counts),
        )
        for tables in block_tables
    )
    return KeptRows(rows=logits_indices, metas=metas)


def _kept_counts(plan: SchedulerOutput) -> list[int] | None:
    """How many last rows of each sequence's chunk the last layer keeps (its sampling rows: the
    last token's and its drafts'), or None where it should compute every row: no row would be
    skipped (a decode step), none kept (a chunk in the middle of a prompt), or prompt-logprob rows
    are scored (rows anywhere in a prompt, not a suffix of its chunk)."""
    if any(s.prompt_logprob_rows for s in plan.requests):
        return None
    counts = [1 + len(s.draft_token_ids) if s.needs_sample else 0 for s in plan.requests]
    if not 0 < sum(counts) < sum(s.num_new_tokens for s in plan.requests):
        return None
    return counts
