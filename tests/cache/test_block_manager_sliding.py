"""BlockManager with a full-attention group and a sliding-window group: blocks that left the
window are released each step, prefix hits need only the window's blocks, invariants hold."""

from __future__ import annotations

from pagedserve.cache.block_manager import BlockManager
from pagedserve.cache.block_table import NULL_BLOCK

N = NULL_BLOCK


def make_manager(num_blocks: int = 20, window: int = 3, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, 2, caching, sliding_windows=(None, window))


def test_a_decode_releases_the_sliding_blocks_that_left_the_window():
    manager = make_manager()
    assert manager.allocate_cached_prefix("a", list(range(6))) == 0
    assert manager.allocate_slots("a", 6, 0)
    assert manager.block_ids("a", 0) == [0, 1, 2]
    assert manager.block_ids("a", 1) == [3, 4, 5]
    manager.check_invariants()
    # Queries from position 6 on see keys from 4 on (window 3, one position of margin): block 3
    # (positions 0-1) is released, and is the first reused (it holds no cached prefix).
    assert manager.allocate_slots("a", 1, 6)
    assert manager.block_ids("a", 0) == [0, 1, 2, 3]
    assert manager.block_ids("a", 1) == [N, 4, 5, 6]
    manager.check_invariants()
    manager.free("a")
    manager.check_invariants()
    assert manager.num_free_blocks == 20


def test_a_failed_allocation_reserves_nothing_but_may_release_out_of_window_blocks():
    manager = make_manager(num_blocks=6)
    manager.allocate_cached_prefix("a", list(range(6)))
    assert manager.allocate_slots("a", 6, 0)
    assert manager.allocate_slots("a", 4, 6) is False  # 2 + 2 blocks needed, 1 free after release
    assert manager.block_ids("a", 0) == [0, 1, 2]
    assert manager.block_ids("a", 1) == [N, 4, 5]
    assert manager.num_free_blocks == 1
    manager.check_invariants()


def test_sliding_group_blocks_stay_bounded_while_the_full_group_grows():
    window, block_size = 8, 4
    manager = BlockManager(200, block_size, True, sliding_windows=(None, window))
    tokens = list(range(1000, 1000 + 8 * window))
    manager.allocate_cached_prefix("a", tokens[:5])
    assert manager.allocate_slots("a", 5, 0)
    manager.cache_computed_blocks("a", tokens, 5)
    for num_computed in range(5, len(tokens)):
        assert manager.allocate_slots("a", 1, num_computed)
        manager.cache_computed_blocks("a", tokens, num_computed + 1)
        manager.check_invariants()
        assert manager.num_held_blocks("a", 1) <= window // block_size + 2
        assert manager.num_held_blocks("a", 0) == -(-(num_computed + 1) // block_size)
    assert manager.num_held_blocks("a", 0) == 16
    assert manager.num_held_blocks("a", 1) == 3
    assert 200 - manager.num_free_blocks == 19
    manager.free("a")
    manager.check_invariants()
    assert manager.num_free_blocks == 200 and manager.pool.usage == 0.0


def _computed_then_decoded(manager: BlockManager, tokens: list[int]) -> None:
    """`a` computes 12 prompt tokens (all blocks cached), then decodes one: its sliding blocks
    0-3 (blocks 6-9) leave the window and go to the free queue, still cached."""
    manager.allocate_cached_prefix("a", tokens)
    assert manager.allocate_slots("a", 12, 0)
    manager.cache_computed_blocks("a", tokens, 12)
    assert manager.allocate_slots("a", 1, 12)
    assert manager.block_ids("a", 1) == [N, N, N, N, 10, 11, 13]
    manager.check_invariants()


def test_a_sliding_prefix_hit_needs_only_the_blocks_its_window_sees():
    manager = make_manager()
    tokens = list(range(100, 112))
    _computed_then_decoded(manager, tokens)
    # The free queue is 14..19 (never used), then 6, 7, 8, 9: seven blocks evict block 6 only.
    manager.allocate_cached_prefix("filler", [7] * 8)
    assert manager.allocate_slots("filler", 6, 0)  # 3 + 3 blocks: 14..19
    # Its own first sliding block (uncached) is released to the front and reused: 7 taken.
    assert manager.allocate_slots("filler", 1, 6)
    assert manager.block_ids("filler", 0) == [14, 15, 16, 17]
    assert manager.block_ids("filler", 1) == [N, 18, 19, 6]
    assert manager.pool.blocks[6].block_hash is None and manager.pool.blocks[7].block_hash
    # b shares 4 tokens (blocks 0 and 1); from position 4 its window needs only block index 1.
    assert manager.allocate_cached_prefix("b", tokens[:4] + [500, 501, 502]) == 4
    assert manager.block_ids("b", 0) == [0, 1]
    assert manager.block_ids("b", 1) == [N, 7]
    manager.check_invariants()


def test_a_sliding_prefix_whose_window_blocks_were_evicted_is_not_reused():
    manager = make_manager()
    tokens = list(range(100, 112))
    _computed_then_decoded(manager, tokens)
    manager.allocate_cached_prefix("filler", [7] * 17)
    assert manager.allocate_slots("filler", 7, 0)  # eight blocks: 6 and 7 evicted
    assert manager.pool.blocks[7].block_hash is None
    # The full group alone would give 4 tokens; the sliding group has neither block 0 nor 1.
    assert manager.allocate_cached_prefix("b", tokens[:4] + [500, 501, 502]) == 0
    assert manager.block_ids("b", 0) == [] and manager.block_ids("b", 1) == []
    manager.check_invariants()
    for request_id in ("a", "filler", "b"):
        manager.free(request_id)
    manager.check_invariants()
    assert manager.num_free_blocks == 20


def test_a_fork_after_the_parent_released_the_childs_window_is_refused():
    manager = make_manager()
    tokens = list(range(100, 112))
    _computed_then_decoded(manager, tokens)
    assert manager.can_fork("a", 12)  # its window (positions 9..11) is still held
    assert not manager.can_fork("a", 6)  # positions 3..5: block index 1 was released
    manager.fork("a", "child", 12)
    assert manager.block_ids("child", 1) == [N, N, N, N, 10, 11]
    manager.check_invariants()
