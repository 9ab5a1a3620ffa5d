"""`BlockManager`: per-sequence block tables on top of the `BlockPool`.

Grows tables by exactly the blocks a step needs (all or nothing), shares blocks between sequences
(prefix caching, fork) and un-shares them before a write (copy-on-write). Knows sequences only by
id: it never imports the scheduler. Pure Python, no tensors.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedserve.cache.block_pool import BlockPool
from pagedserve.cache.block_table import BlockTable, ceil_div

_NO_PARENT = 0  # the chain's seed: the first block of every prompt hashes against it


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
    """Chained SHA-256 of one full block: equal hashes mean equal prefixes up to and including it.

    A cryptographic hash, not Python's `hash()`: with a colliding chain a crafted prompt could be
    served another prompt's K/V (the class of vLLM's CVE-2025-25183). ~1 us per block.
    """
    hasher = hashlib.sha256(parent_hash.to_bytes(32, "little"))
    hasher.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        hasher.update(repr(extra_key).encode())
    return int.from_bytes(hasher.digest(), "little")


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


class BlockManager:
    """sequence_id -> BlockTable, with prefix caching and copy-on-write.

    Invariant: each block's ref_count equals the number of tables that hold it
    (checked by `check_invariants`).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tables: dict[str, BlockTable] = {}
        self._block_hashes: dict[
            str, list[int]
        ] = {}  # chained hashes of each table's cached blocks
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` of context could fit in the whole pool, were it empty."""
        return ceil_div(num_tokens, self.block_size) <= self.pool.num_blocks

    def get_table(self, sequence_id: str) -> BlockTable:
        return self.tables[sequence_id]

    def block_ids(self, sequence_id: str) -> list[int]:
        table = self.tables.get(sequence_id)
        return table.block_ids if table is not None else []

    def allocate_cached_prefix(
        self,
        sequence_id: str,
        token_ids: Sequence[int],
        extra_key: Hashable = None,
        max_cached_tokens: int | None = None,
    ) -> int:
        """Start `sequence_id`'s table with the longest cached prefix of full blocks.

        The block holding the last token is never taken from the cache: its logits must be
        computed, so at least one token is always left to run. `max_cached_tokens` caps the hit
        further (a request that needs the logits of earlier positions); the table is started
        either way, so its computed blocks still fill the cache. Mutates ref counts of hit blocks.

        Returns:
            The number of tokens whose K/V are already cached (a multiple of block_size).
        """
        if sequence_id in self.tables:
            raise RuntimeError(f"sequence {sequence_id} already has a block table")
        table = BlockTable(self.block_size)
        hashes: list[int] = []
        self.tables[sequence_id], self._block_hashes[sequence_id] = table, hashes
        if not self.pool.enable_prefix_caching:
            return 0
        parent = _NO_PARENT
        num_blocks = (len(token_ids) - 1) // self.block_size
        if max_cached_tokens is not None:
            num_blocks = min(num_blocks, max_cached_tokens // self.block_size)
        for idx in range(num_blocks):
            chunk = token_ids[idx * self.block_size : (idx + 1) * self.block_size]
            block_hash = hash_block(parent, chunk, extra_key)
            block = self.pool.lookup(block_hash, parent, chunk)
            if block is None:
                break
            self.pool.touch(block)
            table.block_ids.append(block.block_id)
            hashes.append(block_hash)
            parent = block_hash
        return len(table) * self.block_size

    def allocate_slots(
        self, sequence_id: str, num_new_tokens: int, num_computed_tokens: int
    ) -> bool:
        """Reserve slots for positions [num_computed, num_computed + num_new) of `sequence_id`.

        ```
        | computed (cached) | new this step  |  unreserved
        |<- num_computed -->|<- num_new ---->|
        [ blk ][ blk ][ blk ][ blk ][ new ]      <- required = ceil((computed + new) / size)
        ```
        Also un-shares (copy-on-write) any already reserved block the new tokens write into
        whose ref_count > 1 or that is in the prefix cache; the (src, dst) copies are collected
        by `take_block_copies`.
        Reserving is not computing: no length changes here.

        Returns:
            True on success; False when the pool is short, in which case nothing changed.
        """
        table = self.tables[sequence_id]  # started by allocate_cached_prefix (or fork)
        shared = self._shared_blocks_in_range(table, num_computed_tokens, num_new_tokens)
        num_new_blocks = table.num_blocks_needed(num_computed_tokens, num_new_tokens)
        if num_new_blocks + len(shared) > self.pool.num_free_blocks:
            return False
        for idx in shared:
            self._copy_on_write(table, idx)
        table.block_ids.extend(block.block_id for block in self.pool.allocate(num_new_blocks))
        return True

    def _shared_blocks_in_range(self, table: BlockTable, start: int, num_tokens: int) -> list[int]:
        if num_tokens <= 0:
            return []
        first, last = start // self.block_size, (start + num_tokens - 1) // self.block_size
        blocks = self.pool.blocks
        # Shared blocks, and blocks registered in the prefix cache: a cached block's content is
        # promised to every future hit, so nobody writes into it in place, not even its sole owner.
        return [
            idx
            for idx in range(first, min(last + 1, len(table)))
            if blocks[table.block_ids[idx]].ref_count > 1
            or blocks[table.block_ids[idx]].block_hash is not None
        ]

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
        table, hashes = self.tables[sequence_id], self._block_hashes[sequence_id]
        num_full_blocks = min(num_computed_tokens // self.block_size, len(table))
        parent = hashes[-1] if hashes else _NO_PARENT
        for idx in range(len(hashes), num_full_blocks):
            chunk = token_ids[idx * self.block_size : (idx + 1) * self.block_size]
            block_hash = hash_block(parent, chunk, extra_key)
            self.pool.cache(self.pool.blocks[table.block_ids[idx]], block_hash, parent, chunk)
            hashes.append(block_hash)
            parent = block_hash

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give `child_id` the parent's blocks covering its first `num_tokens` positions (shared).

        Only those blocks: anything the parent wrote past them (its own outputs) is not the
        child's history. Ref counts go up; the first write into a shared block copies it.
        """
        if child_id in self.tables:
            raise RuntimeError(f"sequence {child_id} already has a block table")
        parent = self.tables[parent_id]
        if num_tokens > parent.num_slots:
            raise RuntimeError(
                f"fork of {num_tokens} tokens, but {parent_id} holds {parent.num_slots} slots"
            )
        shared_ids = parent.block_ids[: ceil_div(num_tokens, self.block_size)]
        for block_id in shared_ids:
            self.pool.touch(self.pool.blocks[block_id])
        self.tables[child_id] = BlockTable(self.block_size, list(shared_ids))
        num_full_blocks = num_tokens // self.block_size
        self._block_hashes[child_id] = self._block_hashes[parent_id][:num_full_blocks]

    def trim(self, sequence_id: str, num_tokens: int) -> None:
        """Release the tail blocks beyond the first `num_tokens` positions (slots reserved for
        speculative drafts that were rejected). They hold only dead K/V and are never cached."""
        table = self.tables[sequence_id]
        num_keep = ceil_div(num_tokens, self.block_size)
        if len(table) <= num_keep:
            return
        if len(self._block_hashes[sequence_id]) > num_keep:
            raise RuntimeError(f"{sequence_id}: trimming a block registered in the prefix cache")
        tail = table.block_ids[num_keep:]
        del table.block_ids[num_keep:]
        self.pool.free(self.pool.blocks[block_id] for block_id in reversed(tail))

    def free(self, sequence_id: str) -> None:
        """Release each of the request's block references once; a no-op for an unknown id."""
        table = self.tables.pop(sequence_id, None)
        self._block_hashes.pop(sequence_id, None)
        if table is not None:
            # Tail first: the tail is the least likely to be shared, so it is evicted first.
            self.pool.free(self.pool.blocks[block_id] for block_id in reversed(table.block_ids))

    def snapshot(self) -> BlockManagerSnapshot:
        """Copy every block's ref count and hash flag, and every table (O(num_blocks), no mutation).

        Flat lists, not an object per block: it runs on the engine thread between steps, and a
        poller must not slow the steps down (benchmarks/engine_state.py measures it).
        """
        blocks = self.pool.blocks
        return BlockManagerSnapshot(
            block_size=self.block_size,
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            enable_prefix_caching=self.pool.enable_prefix_caching,
            ref_counts=[block.ref_count for block in blocks],
            is_hashed=[block.block_hash is not None for block in blocks],
            tables={
                sequence_id: list(table.block_ids) for sequence_id, table in self.tables.items()
            },
        )

    def check_invariants(self) -> None:
        """Raise RuntimeError unless ref counts match the tables exactly (plus the pool's own)."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for table in self.tables.values():
            for block_id in table.block_ids:
                holders[block_id] += 1
        for block in self.pool.blocks:
            if block.ref_count != holders[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id}: ref_count {block.ref_count} but held by "
                    f"{holders[block.block_id]} tables"
                )
