"""`ModelRunner`: turns a scheduler plan into one flattened forward pass of a Hugging Face model
whose attention reads and writes the paged KV cache through block tables.

The HF model runs unchanged: we register `paged_attention_forward` with transformers'
`AttentionInterface` under the name "pagedserve" and switch the model to it. Per-step metadata
reaches every attention call as the forward kwarg `paged_context` (HF passes `**kwargs` down
to attention), so nothing is global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface

from pagedserve.cache.attention import AttentionBackend, AttentionMetadata
from pagedserve.cache.cache_engine import CacheEngine
from pagedserve.scheduler import SchedulerOutput

ATTN_IMPLEMENTATION = "pagedserve"


@dataclass(frozen=True, slots=True)
class PagedContext:
    """Everything one step's attention calls need; passed as a forward kwarg."""

    meta: AttentionMetadata
    key_caches: list[Tensor]
    value_caches: list[Tensor]
    backend: AttentionBackend


def paged_attention_forward(
    module: torch.nn.Module,
    query: Tensor,  # [1, num_heads, num_tokens, head_dim], RoPE applied
    key: Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: Tensor | None,  # unused: causality comes from the metadata
    scaling: float | None = None,
    paged_context: PagedContext | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Store this step's K/V at their slots, then attend over each request's paged history."""
    if paged_context is None:
        raise RuntimeError("pagedserve attention called without paged_context (use ModelRunner)")
    for name in _UNSUPPORTED_ATTENTION_KWARGS:  # silently dropping them would change the logits
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the paged attention backends do not implement {name!r}")
    layer_idx = module.layer_idx
    key_cache, value_cache = (
        paged_context.key_caches[layer_idx],
        paged_context.value_caches[layer_idx],
    )
    meta, backend = paged_context.meta, paged_context.backend
    # [num_tokens, heads, head_dim] views: the kernels take strided inputs
    backend.store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache, meta.slot_mapping
    )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = backend.forward(query[0].transpose(0, 1), key_cache, value_cache, meta, scale)
    return out.unsqueeze(0), None  # [1, num_tokens, num_heads, head_dim]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)

# Attention features some families pass that the backends do not implement: logit soft-capping
# (Gemma 2) and attention sinks (GPT-OSS).
_UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "s_aux")
# Rotary variants that pick their scaling from the largest position in the whole flattened batch:
# one long request would change the encoding of every short one batched with it.
_BATCH_DEPENDENT_ROPE = ("longrope", "dynamic")


def check_paged_attention_support(model: torch.nn.Module) -> None:
    """Refuse, at load, a model whose attention would bypass or mis-serve the paged cache.

    Raises:
        ValueError: naming the model class and why.
    """
    name = type(model).__name__
    config = model.config
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        # transformers keeps eager/sdpa, with only a warning, for classes that do not route
        # attention through AttentionInterface: each step would then attend over its own tokens
        # only, across requests, with no history.
        raise ValueError(
            f"{name} does not route attention through transformers' "
            "AttentionInterface, so it cannot read the paged KV cache"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{name} soft-caps attention logits, which the paged kernels do not implement"
        )
    for rope in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if rope_type in _BATCH_DEPENDENT_ROPE:
            raise ValueError(
                f"{name} uses {rope_type!r} RoPE scaling, which depends on the longest "
                "sequence in a batch and would mix requests; it is not supported"
            )


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    input_ids: Tensor  # [1, num_tokens]
    position_ids: Tensor  # [1, num_tokens]
    meta: AttentionMetadata
    # [num_sampling_rows + num_prompt_logprob_rows]: the last token of each request that samples
    # (then one row per draft), then the prompt rows that score the next prompt token (prompt
    # logprobs), both in plan order
    logits_indices: Tensor


class ModelRunner:
    """Runs all scheduled tokens of all sequences as one flattened batch; logits where sampled."""

    def __init__(
        self, model: torch.nn.Module, cache_engine: CacheEngine, backend: AttentionBackend
    ) -> None:
        self.model = model
        self.cache_engine = cache_engine
        self.backend = backend
        self.device = cache_engine.device
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        check_paged_attention_support(model)

    def prepare(self, plan: SchedulerOutput) -> PreparedBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        prompt_logprob_indices: list[int] = []
        for scheduled in plan.requests:
            offset = len(input_ids)
            prompt_logprob_indices.extend(offset + i for i in scheduled.prompt_logprob_rows)
            input_ids.extend(scheduled.token_ids)
            positions.extend(range(scheduled.start_position, scheduled.seq_len))
            slot_mapping.extend(scheduled.slot_mapping)
            query_start_loc.append(len(input_ids))
            seq_lens.append(scheduled.seq_len)
            if scheduled.needs_sample:  # the last real token's row, then one per draft
                num_drafts = len(scheduled.draft_token_ids)
                logits_indices.extend(range(len(input_ids) - 1 - num_drafts, len(input_ids)))
        max_num_blocks = max(len(s.block_ids) for s in plan.requests)
        block_tables = [
            s.block_ids + [0] * (max_num_blocks - len(s.block_ids)) for s in plan.requests
        ]

        def tensor(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slot_mapping, torch.int64),
            block_tables=tensor(block_tables, torch.int32),
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            max_query_len=max(s.num_new_tokens for s in plan.requests),
        )
        return PreparedBatch(
            input_ids=tensor(input_ids, torch.int64).unsqueeze(0),
            position_ids=tensor(positions, torch.int64).unsqueeze(0),
            meta=meta,
            logits_indices=tensor(logits_indices + prompt_logprob_indices, torch.int64),
        )

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> Tensor:
        """Logits [num_logits_rows, vocab_size] in float32, rows as `batch.logits_indices`."""
        context = PagedContext(
            batch.meta, self.cache_engine.key_caches, self.cache_engine.value_caches, self.backend
        )
        output = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            logits_to_keep=batch.logits_indices,
            paged_context=context,
        )
        return output.logits[0].float()

    def execute(self, plan: SchedulerOutput) -> Tensor:
        self.cache_engine.copy_blocks(plan.block_copies)
        return self.forward(self.prepare(plan))
