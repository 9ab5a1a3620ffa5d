"""Block arithmetic of sliding-window layer groups (pure functions for the BlockManager).

A query at position p of a layer with window w sees keys in (p - w, p]. Positions are grouped in
blocks of `block_size`; a block entirely older than every future query's window is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.cache.block_table import ceil_div


def num_blocks_out_of_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks no query at position >= num_computed - 1 can see through `window`.

    One position of margin: a forked choice recomputes its parent's last prompt token.
    """
    return max(0, num_computed_tokens - window) // block_size


def first_block_needed(num_cached_blocks: int, window: int | None, block_size: int) -> int:
    """First block a group needs when positions from num_cached_blocks * block_size run next."""
    if window is None:
        return 0
    return max(0, num_cached_blocks * block_size - window + 1) // block_size


def max_blocks_held(num_tokens: int, window: int | None, step: int, block_size: int) -> int:
    """Blocks one group holds at most for a request of `num_tokens` growing `step` at a time:
    a sliding group holds those overlapping [computed - window, computed + step)."""
    full = ceil_div(num_tokens, block_size)
    return full if window is None else min(full, ceil_div(window + step, block_size) + 1)


def longest_usable_prefix(
    cached: Sequence[Sequence[object | None]],
    windows: Sequence[int | None],
    num_candidates: int,
    block_size: int,
) -> int:
    """Blocks of the longest prefix every group can serve from the cache.

    `cached[g][i]` is group g's cached block i (None: missing), as far as g looked. A full group
    needs every block before the hit; a sliding group only those its window sees from the hit on,
    so its usable lengths are not a prefix-closed set: searched from the right.
    """
    num_hit = min(
        [len(blocks) for blocks, window in zip(cached, windows, strict=True) if window is None]
        + [num_candidates]
    )
    while num_hit > 0 and not all(
        all(
            block is not None
            for block in blocks[first_block_needed(num_hit, w, block_size) : num_hit]
        )
        for blocks, w in zip(cached, windows, strict=True)
    ):
        num_hit -= 1
    return num_hit
