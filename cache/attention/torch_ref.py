"""Readable paged attention in plain torch: the definition of correct for every other backend.

Per request it gathers K/V through the block table into a contiguous copy and runs a masked
float32 softmax, with the per-layer options some families need: a sliding window, logit
soft-capping and attention sinks (see `TorchPagedAttention`). Slow by design (a Python loop and
a copy per request per layer); tests compare the fast backends against it, and it is the warned
fallback when no fast backend can serve.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.cache.attention.metadata import AttentionMetadata


def to_cache_dtype(values: Tensor, dtype: torch.dtype) -> Tensor:
    """New K or V rows in the cache's storage dtype, contiguous; fp8 saturates at its largest
    finite value (448 for e4m3) rather than overflowing to NaN."""
    if dtype.itemsize == 1:  # fp8
        largest = torch.finfo(dtype).max
        values = values.clamp(-largest, largest)
    return values.to(dtype).contiguous()


def store_kv_by_slot(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write token i's K/V into flat slot ``slot_mapping[i]`` of the caches, in place."""
    for new, cache in ((key, key_cache), (value, value_cache)):
        # As bytes: CPU index_copy_ has no fp8 kernel, and a row copy is dtype-blind anyway.
        # NOTE: view(), not reshape(): a copy would silently drop the write.
        rows = cache.view(-1, cache.shape[2], cache.shape[3]).view(torch.uint8)
        rows.index_copy_(0, slot_mapping, to_cache_dtype(new, cache.dtype).view(torch.uint8))


def gather_request_kv(
    cache: Tensor, block_table: Tensor, seq_len: int, first_position: int = 0
) -> Tensor:
    """Copy positions ``first_position..seq_len-1`` of one request out of a paged cache.

    Returns [seq_len - first_position, num_kv_heads, head_dim].
    """
    block_size = cache.shape[1]
    positions = torch.arange(first_position, seq_len, device=cache.device)
    blocks = block_table[positions // block_size].long()  # [seq_len]
    slots = blocks * block_size + positions % block_size  # [seq_len]
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


class TorchPagedAttention:
    """Reference backend: gather + causal masked softmax in float32, one request at a time.

    Per-layer options of `forward`, each off by default:
      * sliding_window: a query at position p sees keys in ``(p - sliding_window, p]`` only
        (transformers' definition: the window counts the query's own position);
      * softcap: scores become ``softcap * tanh(scores / softcap)`` after scaling (Gemma 2);
      * sinks: ``[num_heads]`` learned logits, one per head, that join each row's softmax
        denominator and take no value (GPT-OSS ``s_aux``).
    """

    name = "torch"

    def store_kv(
        self,
        key: Tensor,
        value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        store_kv_by_slot(key, value, key_cache, value_cache, slot_mapping)

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Causal attention; the keyword options are the layer's (see the class docstring)."""
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        group_size = num_heads // num_kv_heads
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        query_start_loc = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            q_len = end - start
            table = meta.block_tables[i]
            # Keys older than every row's window are never read: their blocks may be freed.
            first_key = max(0, seq_len - q_len - sliding_window + 1) if sliding_window else 0
            # Reference only: expanding K/V per query head keeps the math obvious.
            k = gather_request_kv(key_cache, table, seq_len, first_key).float()  # [keys, kv, D]
            v = gather_request_kv(value_cache, table, seq_len, first_key).float()
            k = k.repeat_interleave(group_size, dim=1)  # [seq_len, num_heads, D]
            v = v.repeat_interleave(group_size, dim=1)
            q = query[start:end].float()  # [q_len, num_heads, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, keys]
            options = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks)
            probs = softmax_with_options(scores, seq_len, first_key, **options)
            output[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return output


def attend_over_histories(
    query: Tensor, keys: Tensor, values: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Causal attention over K/V given densely: each request's whole history, in request order.

    For latent attention (MLA), whose K/V are expanded from the paged latent every step. query
    ``[num_tokens, H, Dk]``, keys ``[sum(seq_lens), H, Dk]``, values ``[sum(seq_lens), H, Dv]``;
    returns ``[num_tokens, H, Dv]`` in the query's dtype.
    """
    output = query.new_empty(query.shape[0], query.shape[1], values.shape[-1])
    query_start_loc = meta.query_start_loc.tolist()
    key_start = 0
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q = query[start:end].float()  # [q_len, H, Dk]
        k = keys[key_start : key_start + seq_len].float()  # [seq_len, H, Dk]
        v = values[key_start : key_start + seq_len].float()
        key_start += seq_len
        probs = softmax_with_options(torch.einsum("qhd,khd->hqk", q, k) * scale, seq_len)
        output[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return output


def softmax_with_options(
    scores: Tensor,
    seq_len: int,
    first_key: int = 0,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal softmax of one request's scaled scores ``[H, q_len, keys]``: the queries are the
    last q_len positions before seq_len, the keys positions first_key..seq_len-1."""
    num_heads, q_len = scores.shape[0], scores.shape[1]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_positions = torch.arange(seq_len - q_len, seq_len, device=scores.device)
    key_positions = torch.arange(first_key, seq_len, device=scores.device)
    distance = query_positions[:, None] - key_positions[None, :]  # [q_len, keys]
    is_hidden = distance < 0
    if sliding_window is not None:
        is_hidden |= distance >= sliding_window
    scores = scores.masked_fill(is_hidden, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    # One extra logit per head joins the denominator, dropped after the softmax.
    sink_column = sinks.float().view(num_heads, 1, 1).expand(-1, q_len, 1)
    return torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
