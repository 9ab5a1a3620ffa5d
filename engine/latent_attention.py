"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

transformers' DeepSeek attention writes its compressed latent (kv_lora_rank values, plus the
qk_rope_head_dim shared rotary key) through `cache.update(...)` and only then expands it into
per-head K/V for the attention function. So the paged cache is filled from `update`: this object
stands in for transformers' Cache, writes the step's latents at their slots, and returns every
scheduled request's latent history, read through its block table and concatenated. The model
expands those into K/V, and the attention adapter attends over them per request
(`attend_over_histories`). The cache holds kv_lora_rank + qk_rope_head_dim values per token
and layer, instead of 2 x num_heads x head_dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.cache.attention.metadata import AttentionMetadata
from pagedserve.cache.attention.torch_ref import gather_request_kv, to_cache_dtype


class PagedLatentCache:
    """The `cache` a DeepSeek attention layer calls `update` on, for one step."""

    is_compileable = False

    def __init__(self, meta: AttentionMetadata, latent_caches: list[Tensor]) -> None:
        self.meta = meta
        self.latent_caches = latent_caches  # per layer: [num_blocks, block_size, 1, latent_dim]

    def update(
        self, latent: Tensor, rope_key: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Store this step's latent [1, 1, T, rank] and rotary key [1, 1, T, rope] at their slots;
        return the histories [1, 1, sum(seq_lens), rank] and [1, 1, sum(seq_lens), rope]."""
        cache = self.latent_caches[layer_idx]
        rows = torch.cat([latent, rope_key], dim=-1)[0, 0]  # [T, rank + rope]
        flat = cache.view(-1, cache.shape[-1]).view(torch.uint8)  # bytes: dtype-blind copy
        flat.index_copy_(
            0, self.meta.slot_mapping, to_cache_dtype(rows, cache.dtype).view(torch.uint8)
        )
        histories = torch.cat(
            [
                gather_request_kv(cache, self.meta.block_tables[i], seq_len)
                for i, seq_len in enumerate(self.meta.seq_lens.tolist())
            ]
        )  # [sum(seq_lens), 1, rank + rope]
        histories = histories.to(latent.dtype).transpose(0, 1).unsqueeze(0)
        rank = latent.shape[-1]
        return histories[..., :rank], histories[..., rank:]
