"""`BlockPool`: owns every KV block id, its reference count, and the prefix-cache hash index.

Pure Python bookkeeping (no tensors): the CacheEngine owns the memory the ids point into.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class DoubleFreeError(RuntimeError):
    """A block was released more often than it was referenced: a bookkeeping bug, never ignored."""


class OutOfBlocksError(RuntimeError):
    """`allocate(n)` was asked for more blocks than are free (callers check first)."""


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block. `block_hash` is set once the block is full and computed."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # The hash of the previous block and this block's token ids: compared on lookup so that a
    # hash collision can never hand out another prefix's K/V.
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Free queue + ref counts + hash -> block index over `num_blocks` KV blocks.

    Invariants (checked by `check_invariants`):
      * every block is either free (ref_count == 0, in the free queue) or referenced (> 0),
        never both;
      * num_free_blocks + #(blocks with ref_count > 0) == num_blocks;
      * every hashed block is indexed under its hash.
    The free queue is least-recently-freed first: `allocate` takes from the front, so cached
    blocks freed long ago are evicted before recently freed ones (LRU). Blocks with no hash carry
    nothing worth keeping and are put at the front, to be reused before any cached block.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # OrderedDict gives O(1) pop from the front, append at either end, and removal of a
        # revived block from the middle.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._hash_to_block: dict[int, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` free blocks, each with ref_count 1; evicts their old hashes.

        All or nothing: raises OutOfBlocksError (and changes nothing) when too few are free.
        """
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, block: Block) -> None:
        """Add a reference to `block`, reviving it from the free queue if it was free."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drop one reference; at zero the block returns to the free queue (hash kept).

        Raises:
            DoubleFreeError: the block has no reference left to drop.
        """
        if block.ref_count <= 0:
            raise DoubleFreeError(
                f"block {block.block_id} released with ref_count {block.ref_count}"
            )
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = block
            if block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def free(self, blocks: Iterable[Block]) -> None:
        """Release each block once (callers pass a table tail-first: its tail is evicted first)."""
        for block in blocks:
            self.release(block)

    def cache(
        self, block: Block, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> None:
        """Register a full, computed block under its chained hash (first writer wins)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._hash_to_block:
            return  # an identical block is already cached; this one stays private
        block.block_hash, block.parent_hash, block.token_ids = (
            block_hash,
            parent_hash,
            tuple(token_ids),
        )
        self._hash_to_block[block_hash] = block

    def lookup(
        self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> Block | None:
        """The cached block holding exactly these tokens after exactly this parent, if any."""
        block = self._hash_to_block.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's /reset_prefix_cache, SGLang's /flush_cache), so the
        next requests compute their prompts whole. Only while no block is referenced: a running
        request's shared blocks stay as they are. Returns whether the cache was reset."""
        if len(self._free) != self.num_blocks:
            return False
        for block in list(self._hash_to_block.values()):
            self._evict(block)
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def check_invariants(self) -> None:
        """Raise RuntimeError with the numbers if the bookkeeping is inconsistent."""
        num_referenced = sum(1 for b in self.blocks if b.ref_count > 0)
        if any(b.ref_count < 0 for b in self.blocks):
            raise RuntimeError("negative ref_count")
        if num_referenced + len(self._free) != self.num_blocks:
            raise RuntimeError(
                f"free {len(self._free)} + referenced {num_referenced} != total {self.num_blocks}"
            )
        for block in self._free.values():
            if block.ref_count != 0:
                raise RuntimeError(
                    f"block {block.block_id} is free with ref_count {block.ref_count}"
                )
        for block_hash, block in self._hash_to_block.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"hash index points at block {block.block_id} with another hash")
