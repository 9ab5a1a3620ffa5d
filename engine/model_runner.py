"""`ModelRunner`: turns a scheduler plan into one flattened forward pass of a Hugging Face model
whose attention reads and writes the paged KV cache through block tables.

The HF model runs unchanged: we register `paged_attention_forward` with transformers'
`AttentionInterface` under the name "pagedserve" and switch the model to it. Per-step metadata
reaches every attention call as the forward kwarg `paged_context` (HF passes `**kwargs` down
to attention), so nothing is global.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface

from pagedserve.cache.attention import AttentionBackend, AttentionMetadata
from pagedserve.cache.attention.torch_ref import attend_over_histories
from pagedserve.cache.cache_engine import CacheEngine
from pagedserve.configs import ModelConfig, SamplingParams
from pagedserve.engine.classifier import is_sequence_classifier
from pagedserve.engine.embeddings import FinalHiddenStates
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.kept_rows import KeptRows, keeps_rows, kept_rows
from pagedserve.engine.latent_attention import PagedLatentCache
from pagedserve.engine.lora import check_lora, load_lora_adapters
from pagedserve.engine.model_support import ATTN_IMPLEMENTATION, check_paged_attention_support
from pagedserve.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class PagedContext:
    """Everything one step's attention calls need; passed as a forward kwarg."""

    metas: tuple[AttentionMetadata, ...]  # one per layer group (block tables differ)
    key_caches: list[Tensor]  # per layer
    value_caches: list[Tensor]
    group_of_layer: list[int]
    sliding_windows: tuple[int | None, ...]  # per group, as the block manager frees blocks
    backend: AttentionBackend
    is_latent: bool = False  # MLA: K/V arrive expanded from the latent histories (see below)
    # The rows the last decoder layer computes, where it can compute fewer (engine/kept_rows.py)
    kept: KeptRows | None = None
    # Metadata of the queries where they are a subset of the stored rows (kept rows); else `metas`
    query_metas: tuple[AttentionMetadata, ...] | None = None

    def group_for(self, layer_idx: int, sliding_window: int | None) -> int:
        """The layer's cache group, checked against the window the layer attends with: the
        block manager would otherwise free (or keep) blocks the layer reads."""
        group = self.group_of_layer[layer_idx]
        if sliding_window != self.sliding_windows[group]:
            raise RuntimeError(
                f"layer {layer_idx} attends with sliding_window={sliding_window}, but its cache "
                f"group was built for {self.sliding_windows[group]}"
            )
        return group


def paged_attention_forward(
    module: torch.nn.Module,
    query: Tensor,  # [1, num_heads, num_tokens, head_dim], RoPE applied
    key: Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: Tensor | None,  # unused: causality comes from the metadata
    scaling: float | None = None,
    paged_context: PagedContext | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Store this step's K/V at their slots, then attend over each request's paged history.

    The layer's own options arrive as the kwargs transformers passes every attention function:
    `sliding_window`, `softcap` (Gemma 2) and `s_aux` (GPT-OSS sinks, one logit per head).
    """
    if paged_context is None:
        raise RuntimeError("pagedserve attention called without paged_context (use ModelRunner)")
    layer_idx = module.layer_idx
    group = paged_context.group_for(layer_idx, sliding_window)
    key_cache, value_cache = (
        paged_context.key_caches[layer_idx],
        paged_context.value_caches[layer_idx],
    )
    meta, backend = paged_context.metas[group], paged_context.backend
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # [num_tokens, heads, head_dim] views: the kernels take strided inputs
    query, key, value = (states[0].transpose(0, 1) for states in (query, key, value))
    if paged_context.is_latent:  # the latent was stored by PagedLatentCache.update already
        return attend_over_histories(query, key, value, meta, scale).unsqueeze(0), None
    backend.store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    if paged_context.query_metas is not None:  # the queries are some of the stored rows
        meta = paged_context.query_metas[group]
    options = dict(sliding_window=sliding_window, softcap=softcap, sinks=s_aux)
    out = backend.forward(query, key_cache, value_cache, meta, scale, **options)
    return out.unsqueeze(0), None  # [1, num_tokens, num_heads, head_dim]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    input_ids: Tensor  # [1, num_tokens]
    position_ids: Tensor  # [1, num_tokens]
    metas: tuple[AttentionMetadata, ...]  # one per layer group
    # [num_sampling_rows + num_prompt_logprob_rows]: see `_logits_indices`
    logits_indices: Tensor
    kept: KeptRows | None = None  # where the last layer computes only the logits rows
    # Per sequence (plan order): its LoRA adapter's load (0: the base model), its number of rows.
    lora_rows: tuple[tuple[int, int], ...] = ()


class ModelRunner:
    """Runs all scheduled tokens of all sequences as one flattened batch; logits where sampled."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache_engine: CacheEngine,
        backend: AttentionBackend,
        model_config: ModelConfig | None = None,
    ) -> None:
        self.model = model
        # LoRA adapters (--enable-lora), wrapped into the model after the CPU swaps.
        self.lora = load_lora_adapters(model_config, model) if model_config else None
        self.cache_engine = cache_engine
        self.backend = backend
        self.device = cache_engine.device
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        check_paged_attention_support(model)
        self.keeps_rows = keeps_rows(model)
        self.hidden = FinalHiddenStates(model)
        self.classifies = is_sequence_classifier(model.config)  # its LM head is untrained

    def prepare(self, plan: SchedulerOutput) -> PreparedBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for scheduled in plan.requests:
            input_ids.extend(scheduled.token_ids)
            positions.extend(range(scheduled.start_position, scheduled.seq_len))
            query_start_loc.append(len(input_ids))
            seq_lens.append(scheduled.seq_len)

        def tensor(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        tables = [
            _padded_block_tables(plan.requests, group)
            for group in range(len(self.cache_engine.spec.groups))
        ]
        shared = dict(
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            max_query_len=max(s.num_new_tokens for s in plan.requests),
        )
        metas = tuple(
            AttentionMetadata(
                slot_mapping=tensor(slots, torch.int64),
                block_tables=tensor(rows, torch.int32),
                **shared,
            )
            for slots, rows in zip(_slot_mappings(plan, len(tables)), tables, strict=True)
        )
        logits_indices = tensor(_logits_indices(plan), torch.int64)
        return PreparedBatch(
            input_ids=tensor(input_ids, torch.int64).unsqueeze(0),
            position_ids=tensor(positions, torch.int64).unsqueeze(0),
            metas=metas,
            logits_indices=logits_indices,
            kept=kept_rows(plan, logits_indices, tables, self.device) if self.keeps_rows else None,
            lora_rows=_lora_rows(plan) if self.lora else (),
        )

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> Tensor:
        """Logits [num_logits_rows, vocab_size] in the model's dtype, rows as
        `batch.logits_indices` (the engine widens them where a step needs more than argmax)."""
        engine = self.cache_engine
        context = PagedContext(
            batch.metas,
            engine.key_caches,
            engine.value_caches,
            engine.group_of_layer,
            engine.spec.sliding_windows,
            self.backend,
            is_latent=engine.spec.latent,
            kept=batch.kept,
        )
        if self.lora is not None:
            self.lora.set_step(batch.lora_rows, None if batch.kept is None else batch.kept.rows)
        # MLA writes its latent through `cache.update`: give it the paged latent cache.
        latent_cache = {}
        if engine.spec.latent:
            latent_cache["cache"] = PagedLatentCache(batch.metas[0], engine.key_caches)
        output = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            # the last layer returned the logits rows alone, in order: keep all (0) of them
            logits_to_keep=0 if batch.kept is not None else batch.logits_indices,
            paged_context=context,
            **latent_cache,
        )
        return output.logits[0]

    def check_request(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError for a LoRA adapter not served, an embedding this model
        cannot give, or generation from a classifier."""
        check_lora(params.lora, self.lora)
        if params.embed and not self.hidden.available:
            raise InvalidRequestError("this model has no final norm to embed from", "model")
        if self.classifies and not params.embed:
            raise InvalidRequestError(
                "this model is a sequence classifier: it serves /classify, /score, /rerank and "
                "/v1/embeddings, not generation",
                "model",
            )

    def execute(self, plan: SchedulerOutput, embed: Collection[str] = ()) -> Tensor:
        """Logits of the step's rows; `embed`: sampling sequences whose final hidden state the
        step keeps (engine/embeddings.py)."""
        self.cache_engine.copy_blocks(plan.block_copies)
        batch = self.prepare(plan)
        self.hidden.arm(plan, embed, batch.logits_indices, all_tokens=batch.kept is None)
        try:
            return self.forward(batch)
        finally:
            self.hidden.disarm()  # a forward that failed before the final norm leaves no rows


def _lora_rows(plan: SchedulerOutput) -> tuple[tuple[int, int], ...]:
    return tuple((scheduled.lora, scheduled.num_new_tokens) for scheduled in plan.requests)


def _logits_indices(plan: SchedulerOutput) -> list[int]:
    """Rows whose logits are kept, in this order: each sampling sequence's last real token and one
    row per draft (plan order), then the prompt rows that score prompt logprobs (plan order)."""
    sampling_rows: list[int] = []
    prompt_rows: list[int] = []
    offset = 0
    for scheduled in plan.requests:
        prompt_rows.extend(offset + i for i in scheduled.prompt_logprob_rows)
        offset += scheduled.num_new_tokens
        if scheduled.needs_sample:  # the last real token's row, then one per draft
            num_drafts = len(scheduled.draft_token_ids)
            sampling_rows.extend(range(offset - 1 - num_drafts, offset))
    return sampling_rows + prompt_rows


def _slot_mappings(plan: SchedulerOutput, num_groups: int) -> list[list[int]]:
    """Per cache group, the slot of each of the step's tokens, in batch order."""
    return [[slot for s in plan.requests for slot in s.slot_mappings[g]] for g in range(num_groups)]


def _padded_block_tables(requests: list[ScheduledRequest], group: int) -> list[list[int]]:
    """Rows of one group's block tables, padded with block 0; a released entry (NULL_BLOCK) also
    reads as block 0: it lies outside the layer's window, so no kernel loads it."""
    rows = [[max(block, 0) for block in s.block_tables[group]] for s in requests]
    width = max(len(row) for row in rows)
    return [row + [0] * (width - len(row)) for row in rows]
