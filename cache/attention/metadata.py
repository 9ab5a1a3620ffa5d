"""Per-step attention metadata: where each new token's K/V goes and which blocks each request reads.

Built once per step by the engine's model runner and shared by every layer; this module holds no
logic beyond the data contract.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One flattened batch of requests: decode tokens (query length 1) and prefill chunks.

    Causality: query row j (0-based within request i's chunk) sits at position
    ``seq_lens[i] - q_len_i + j`` and attends to positions ``0..that position`` (the cached prefix
    plus the causal part of its own chunk), where
    ``q_len_i = query_start_loc[i+1] - query_start_loc[i]``.

    Invariant: ``1 <= q_len_i <= seq_lens[i]`` and ``block_tables[i]`` names at least
    ``ceil(seq_lens[i] / block_size)`` blocks; entries past that are padding (0) and never read.
    """

    slot_mapping: Tensor  # [num_tokens] int64: flat KV slot each new token writes to
    block_tables: Tensor  # [num_reqs, max_num_blocks_per_req] int32, padded with 0
    query_start_loc: Tensor  # [num_reqs + 1] int32: cumulative new-token counts
    seq_lens: Tensor  # [num_reqs] int32: context length including this step's new tokens
    max_query_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
