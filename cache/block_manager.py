"""`BlockManager`: per-sequence block tables, one per layer group, on top of one `BlockPool`.

Grows tables by exactly the blocks a step needs (all or nothing), shares blocks between sequences
(prefix caching, fork) and un-shares them before a write (copy-on-write). A sliding-window group
releases the blocks no future query can see: their entries become `NULL_BLOCK`, so a long request
holds about window / block_size + 1 blocks there. Knows sequences only by id: it never imports the
scheduler. Pure Python, no tensors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedserve.cache.block_fork import can_fork, fork
from pagedserve.cache.block_hash import hash_block, lookup_chain
from pagedserve.cache.block_pool import BlockPool
from pagedserve.cache.block_snapshot import BlockManagerSnapshot, snapshot_block_manager
from pagedserve.cache.block_table import NULL_BLOCK, BlockTable, ceil_div
from pagedserve.cache.sliding_window import (
    first_block_needed,
    longest_usable_prefix,
    max_blocks_held,
    num_blocks_out_of_window,
)

_NO_PARENT = 0  # group 0's chain seed; group g seeds its chain with g, so groups never share hashes


class BlockManager:
    """sequence_id -> one BlockTable per layer group, with prefix caching and copy-on-write:
    `sliding_windows[g]` is group g's window (None: full attention); the default is one full
    group. `tables` is group 0's map, the only one for a single-group model. `max_step_tokens`:
    the most tokens one step schedules for a sequence (bounds a sliding group; None: unknown).
    Invariant: each block's ref_count equals its table entries over all groups (`check_invariants`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        self.max_step_tokens: int | None = None  # see the class docstring; set by the engine
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.sliding_windows = tuple(sliding_windows)
        self.group_tables: list[dict[str, BlockTable]] = [{} for _ in self.sliding_windows]
        # chained hashes of each table's cached blocks, per group
        self._group_hashes: list[dict[str, list[int]]] = [{} for _ in self.sliding_windows]
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def tables(self) -> dict[str, BlockTable]:
        return self.group_tables[0]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_needed_at_most(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` holds at most, over all groups."""
        step = num_tokens if self.max_step_tokens is None else self.max_step_tokens
        return sum(
            max_blocks_held(num_tokens, window, step, self.block_size)
            for window in self.sliding_windows
        )

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` of context could fit in the whole pool, were it empty."""
        return self.num_blocks_needed_at_most(num_tokens) <= self.pool.num_blocks

    def get_table(self, sequence_id: str, group: int = 0) -> BlockTable:
        return self.group_tables[group][sequence_id]

    def block_ids(self, sequence_id: str, group: int = 0) -> list[int]:
        table = self.group_tables[group].get(sequence_id)
        return table.block_ids if table is not None else []

    def num_held_blocks(self, sequence_id: str, group: int = 0) -> int:
        table = self.group_tables[group].get(sequence_id)
        return table.num_held_blocks if table is not None else 0

    def allocate_cached_prefix(
        self,
        sequence_id: str,
        token_ids: Sequence[int],
        extra_key: Hashable = None,
        max_cached_tokens: int | None = None,
    ) -> int:
        """Start `sequence_id`'s tables with the longest cached prefix of full blocks.

        The block holding the last token is never taken from the cache: its logits must be
        computed, so at least one token is always left to run. `max_cached_tokens` caps the hit
        further (a request that needs the logits of earlier positions); the tables are started
        either way, so their computed blocks still fill the cache. A sliding group needs only the
        blocks its window sees from the first uncached position: the longest prefix for which
        every full group has all blocks and every sliding group those blocks wins. Mutates ref
        counts of hit blocks.

        Returns:
            The number of tokens whose K/V are already cached (a multiple of block_size).
        """
        if sequence_id in self.tables:
            raise RuntimeError(f"sequence {sequence_id} already has a block table")
        for tables, hashes in zip(self.group_tables, self._group_hashes, strict=True):
            tables[sequence_id], hashes[sequence_id] = BlockTable(self.block_size), []
        if not self.pool.enable_prefix_caching:
            return 0
        num_candidates = max(0, (len(token_ids) - 1) // self.block_size)
        if max_cached_tokens is not None:
            num_candidates = min(num_candidates, max_cached_tokens // self.block_size)
        groups = range(len(self.sliding_windows))
        found = [self._lookup(group, token_ids, num_candidates, extra_key) for group in groups]
        num_hit = longest_usable_prefix(
            [blocks for _, blocks in found], self.sliding_windows, num_candidates, self.block_size
        )
        for group, (hashes, blocks) in enumerate(found):
            self._take_hits(group, sequence_id, hashes[:num_hit], blocks[:num_hit])
        return num_hit * self.block_size

    def _lookup(
        self, group: int, token_ids: Sequence[int], num_candidates: int, extra_key: Hashable
    ) -> tuple[list[int], list]:
        """Group `group`'s cached chain over the first `num_candidates` full blocks (a full group
        stops at its first miss; a sliding group keeps looking past it)."""
        window = self.sliding_windows[group]
        seed = _NO_PARENT + group
        return lookup_chain(
            self.pool, seed, token_ids, num_candidates, self.block_size, extra_key, window is None
        )

    def _take_hits(self, group: int, sequence_id: str, hashes: list[int], blocks: list) -> None:
        """Start the group's table with the hit blocks its window needs (before them: NULL)."""
        table = self.group_tables[group][sequence_id]
        first = first_block_needed(len(blocks), self.sliding_windows[group], self.block_size)
        table.block_ids.extend([NULL_BLOCK] * first)
        for block in blocks[first:]:
            self.pool.touch(block)
            table.block_ids.append(block.block_id)
        self._group_hashes[group][sequence_id].extend(hashes)

    def allocate_slots(
        self, sequence_id: str, num_new_tokens: int, num_computed_tokens: int
    ) -> bool:
        """Reserve slots for positions [num_computed, num_computed + num_new) in every group.

        ```
        | computed (cached) | new this step  |  unreserved
        |<- num_computed -->|<- num_new ---->|
        [ blk ][ blk ][ blk ][ blk ][ new ]      <- required = ceil((computed + new) / size)
        ```
        First, sliding groups release the blocks that left their window (even if this call then
        fails: no future query reads them). Also un-shares (copy-on-write) any reserved block the
        new tokens write into whose ref_count > 1 or that is in the prefix cache; the (src, dst)
        copies are collected by `take_block_copies`. Reserving is not computing.

        Returns:
            True on success; False when the pool is short, in which case no block was reserved.
        """
        tables = [group[sequence_id] for group in self.group_tables]  # from the prefix or fork
        for table, window in zip(tables, self.sliding_windows, strict=True):
            if window is not None:
                self._release_out_of_window(table, window, num_computed_tokens)
        shared = [
            self._shared_blocks_in_range(t, num_computed_tokens, num_new_tokens) for t in tables
        ]
        num_needed = sum(
            table.num_blocks_needed(num_computed_tokens, num_new_tokens) + len(indices)
            for table, indices in zip(tables, shared, strict=True)
        )
        if num_needed > self.pool.num_free_blocks:
            return False
        for table, indices in zip(tables, shared, strict=True):
            for idx in indices:
                self._copy_on_write(table, idx)
            num_new_blocks = table.num_blocks_needed(num_computed_tokens, num_new_tokens)
            table.block_ids.extend(block.block_id for block in self.pool.allocate(num_new_blocks))
        return True

    def _release_out_of_window(self, table: BlockTable, window: int, num_computed: int) -> None:
        # Entries are released left to right, so those before the first NULL_BLOCK met going left
        # are already released: O(blocks released), not O(table).
        first = num_out = min(
            num_blocks_out_of_window(num_computed, window, self.block_size), len(table)
        )
        while first > 0 and table.block_ids[first - 1] != NULL_BLOCK:
            first -= 1
        # Oldest first into the free queue, so the oldest is the first evicted from the cache.
        for idx in range(first, num_out):
            self.pool.release(self.pool.blocks[table.block_ids[idx]])
            table.block_ids[idx] = NULL_BLOCK

    def _shared_blocks_in_range(self, table: BlockTable, start: int, num_tokens: int) -> list[int]:
        if num_tokens <= 0:
            return []
        first, last = start // self.block_size, (start + num_tokens - 1) // self.block_size
        # Shared blocks, and blocks registered in the prefix cache: a cached block's content is
        # promised to every future hit, so nobody writes into it in place, not even its sole owner.
        # Writes never reach a released entry (-1 would index the last block): they lie
        # before the window, which starts at or before `start`.
        ids = table.block_ids
        held = [(i, self.pool.blocks[ids[i]]) for i in range(first, min(last + 1, len(ids)))]
        return [idx for idx, block in held if block.ref_count > 1 or block.block_hash is not None]

    def _copy_on_write(self, table: BlockTable, idx: int) -> None:
        old = self.pool.blocks[table.block_ids[idx]]
        (new,) = self.pool.allocate(1)
        self._pending_copies.append((old.block_id, new.block_id))
        self.pool.release(old)
        table.block_ids[idx] = new.block_id

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies the CacheEngine must run before the next forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def cache_computed_blocks(
        self,
        sequence_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        extra_key: Hashable = None,
    ) -> None:
        """Register each block of `sequence_id` now full and computed in the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        for group in range(len(self.sliding_windows)):
            table = self.group_tables[group][sequence_id]
            hashes = self._group_hashes[group][sequence_id]
            num_full_blocks = min(num_computed_tokens // self.block_size, len(table))
            parent = hashes[-1] if hashes else _NO_PARENT + group
            for idx in range(len(hashes), num_full_blocks):
                chunk = token_ids[idx * self.block_size : (idx + 1) * self.block_size]
                block_hash = hash_block(parent, chunk, extra_key)
                if table.block_ids[idx] != NULL_BLOCK:  # the chain goes on past released blocks
                    block = self.pool.blocks[table.block_ids[idx]]
                    self.pool.cache(block, block_hash, parent, chunk)
                hashes.append(block_hash)
                parent = block_hash

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        """Whether the parent still holds every block a child of `num_tokens` tokens needs."""
        return can_fork(self, parent_id, num_tokens)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Share the parent's blocks of the first `num_tokens` positions with `child_id`."""
        fork(self, parent_id, child_id, num_tokens)

    def trim(self, sequence_id: str, num_tokens: int) -> None:
        """Release, in every group, the tail blocks beyond the first `num_tokens` positions (slots
        reserved for speculative drafts that were rejected): dead K/V, never cached."""
        num_keep = ceil_div(num_tokens, self.block_size)
        for tables, hashes in zip(self.group_tables, self._group_hashes, strict=True):
            table = tables[sequence_id]
            if len(table) <= num_keep:
                continue
            if len(hashes[sequence_id]) > num_keep:
                raise RuntimeError(f"{sequence_id}: trimming a prefix-cached block")
            tail = [block_id for block_id in table.block_ids[num_keep:] if block_id != NULL_BLOCK]
            del table.block_ids[num_keep:]
            self.pool.free(self.pool.blocks[block_id] for block_id in reversed(tail))

    def free(self, sequence_id: str) -> None:
        """Release each of the sequence's block references once; a no-op for an unknown id."""
        for tables, hashes in zip(self.group_tables, self._group_hashes, strict=True):
            table = tables.pop(sequence_id, None)
            hashes.pop(sequence_id, None)
            if table is not None:
                # Tail first: the tail is the least likely to be shared, so it is evicted first.
                self.pool.free(
                    self.pool.blocks[block_id]
                    for block_id in reversed(table.block_ids)
                    if block_id != NULL_BLOCK
                )

    def snapshot(self) -> BlockManagerSnapshot:
        """Copy every block's ref count and hash flag, and group 0's tables (no mutation)."""
        return snapshot_block_manager(self)

    def check_invariants(self) -> None:
        """Raise RuntimeError unless ref counts match the tables exactly (plus the pool's own)."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for tables in self.group_tables:
            for table in tables.values():
                for block_id in table.block_ids:
                    if block_id != NULL_BLOCK:
                        holders[block_id] += 1
        for block in self.pool.blocks:
            if block.ref_count != holders[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id}: ref_count {block.ref_count} but held by "
                    f"{holders[block.block_id]} tables"
                )
