"""Helpers shared by the BlockManager unit tests: a small manager, a snapshot of its state, and
admitting a prompt the way the scheduler does."""

from collections.abc import Sequence

from pagedserve.cache.block_manager import BlockManager

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 8, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)


def manager_state(manager: BlockManager) -> tuple:
    """Tables, ref counts, hashes and free count: all that a failed call must leave untouched."""
    return (
        {request_id: list(table.block_ids) for request_id, table in manager.tables.items()},
        [b.ref_count for b in manager.pool.blocks],
        [b.block_hash for b in manager.pool.blocks],
        manager.num_free_blocks,
    )


def run_prompt(
    manager: BlockManager, request_id: str, token_ids: Sequence[int], extra_key=None
) -> int:
    """Admit a prompt as the scheduler would: cached prefix, reserve the rest, compute, cache."""
    num_cached_tokens = manager.allocate_cached_prefix(request_id, token_ids, extra_key)
    assert manager.allocate_slots(request_id, len(token_ids) - num_cached_tokens, num_cached_tokens)
    manager.cache_computed_blocks(request_id, token_ids, len(token_ids), extra_key)
    return num_cached_tokens


def allocate_new(manager: BlockManager, sequence_id: str, num_tokens: int) -> bool:
    """Admit an uncached prompt of `num_tokens` as the scheduler would: start the table (nothing
    cached), reserve its slots, and on failure give the table back (nothing changed)."""
    assert manager.allocate_cached_prefix(sequence_id, []) == 0
    if manager.allocate_slots(sequence_id, num_tokens, 0):
        return True
    manager.free(sequence_id)
    return False


def fill_with_single_block_requests(manager: BlockManager) -> None:
    """Give request f<i> block i for every block of the pool."""
    for block_id in range(manager.pool.num_blocks):
        assert allocate_new(manager, f"f{block_id}", BLOCK_SIZE)
        assert manager.block_ids(f"f{block_id}") == [block_id]


PROMPT = list(range(100, 113))  # 13 tokens: three full blocks + one token
