"""Prefix-cache hashes: a chained SHA-256 per full block, and the lookup of a prompt's chain."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence

from pagedserve.cache.block_pool import Block, BlockPool


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


def lookup_chain(
    pool: BlockPool,
    seed: int,
    token_ids: Sequence[int],
    num_blocks: int,
    block_size: int,
    extra_key: Hashable,
    stop_at_miss: bool,
) -> tuple[list[int], list[Block | None]]:
    """The chained hashes and cached blocks (None: missing) of the first `num_blocks` blocks,
    stopping at the first miss if asked (a sliding group looks past misses outside its window)."""
    hashes: list[int] = []
    blocks: list[Block | None] = []
    parent = seed
    for idx in range(num_blocks):
        chunk = token_ids[idx * block_size : (idx + 1) * block_size]
        block_hash = hash_block(parent, chunk, extra_key)
        block = pool.lookup(block_hash, parent, chunk)
        if block is None and stop_at_miss:
            break
        hashes.append(block_hash)
        blocks.append(block)
        parent = block_hash
    return hashes, blocks
