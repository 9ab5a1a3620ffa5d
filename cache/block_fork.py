"""n > 1 forks: a child choice shares its parent's blocks of the prompt (ref counts up; the first
write into a shared block copies it). The block manager's own helpers: they read and extend its
per-group tables and hashes, as its methods `can_fork` and `fork` do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.cache.block_table import NULL_BLOCK, BlockTable, ceil_div
from pagedserve.cache.sliding_window import num_blocks_out_of_window

if TYPE_CHECKING:  # the manager imports this module: a runtime import would be circular
    from pagedserve.cache.block_manager import BlockManager


def can_fork(manager: BlockManager, parent_id: str, num_tokens: int) -> bool:
    """Whether the parent still holds every block a child of `num_tokens` tokens needs to
    recompute its last token (a sliding group may have released them since)."""
    end = ceil_div(num_tokens, manager.block_size)
    for tables, window in zip(manager.group_tables, manager.sliding_windows, strict=True):
        first = num_blocks_out_of_window(num_tokens, window, manager.block_size) if window else 0
        if NULL_BLOCK in tables[parent_id].block_ids[first:end]:
            return False
    return True


def fork(manager: BlockManager, parent_id: str, child_id: str, num_tokens: int) -> None:
    """Give `child_id` the parent's blocks covering its first `num_tokens` positions (shared).

    Only those blocks: anything the parent wrote past them (its own outputs) is not the
    child's history. Ref counts go up; the first write into a shared block copies it.
    Raises RuntimeError unless `can_fork`.
    """
    if child_id in manager.tables:
        raise RuntimeError(f"sequence {child_id} already has a block table")
    parent = manager.tables[parent_id]
    if num_tokens > parent.num_slots or not can_fork(manager, parent_id, num_tokens):
        raise RuntimeError(
            f"fork of {num_tokens} tokens, but {parent_id} holds {parent.num_slots} slots "
            "or released some of them out of a sliding window"
        )
    end = ceil_div(num_tokens, manager.block_size)
    for group in range(len(manager.sliding_windows)):
        shared_ids = manager.group_tables[group][parent_id].block_ids[:end]
        for block_id in shared_ids:
            if block_id != NULL_BLOCK:
                manager.pool.touch(manager.pool.blocks[block_id])
        manager.group_tables[group][child_id] = BlockTable(manager.block_size, list(shared_ids))
        num_full_blocks = num_tokens // manager.block_size
        hashes = manager._group_hashes[group]
        hashes[child_id] = hashes[parent_id][:num_full_blocks]
