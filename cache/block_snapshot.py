"""A copy of the block bookkeeping at one instant, for the engine-state page (issue 22).

Pure Python: taken on the engine thread between steps, read on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BlockManagerSnapshot", "snapshot_block_manager"]


@dataclass(frozen=True, slots=True)
class BlockManagerSnapshot:
    """A copy of the block bookkeeping at one instant: plain values, safe to read on any thread.

    Columns are indexed by block id. A block is free when its ref count is 0; a free block whose
    hash is still registered is "cached-free" (a later identical prefix can revive it).
    """

    block_size: int
    num_blocks: int
    num_free_blocks: int
    enable_prefix_caching: bool
    ref_counts: list[int]
    is_hashed: list[bool]  # registered in the prefix-cache index under its chained hash
    tables: dict[str, list[int]]  # sequence id -> block ids in logical order


def snapshot_block_manager(manager: Any) -> BlockManagerSnapshot:
    """Copy every block's ref count and hash flag, and every table (O(num_blocks), no mutation).

    Flat lists, not an object per block: it runs on the engine thread between steps, and a
    poller must not slow the steps down (benchmarks/engine_state.py measures it). The tables are
    group 0's (the only group of a model without sliding-window layers).
    """
    blocks = manager.pool.blocks
    return BlockManagerSnapshot(
        block_size=manager.block_size,
        num_blocks=manager.pool.num_blocks,
        num_free_blocks=manager.pool.num_free_blocks,
        enable_prefix_caching=manager.pool.enable_prefix_caching,
        ref_counts=[block.ref_count for block in blocks],
        is_hashed=[block.block_hash is not None for block in blocks],
        tables={
            sequence_id: list(table.block_ids) for sequence_id, table in manager.tables.items()
        },
    )
