"""BlockManager fork and copy-on-write, with exact block ids: a child shares the parent's blocks, the
first write into a shared (or cached) block copies it, a copy that cannot get a block changes
nothing, freeing both sides returns every block, and a diverging child caches its own hash chain."""

import pytest

from tests.cache.support import PROMPT, allocate_new, make_manager, manager_state, run_prompt

# --- fork and copy-on-write -----------------------------------------------------------------


def test_fork_shares_every_block_of_the_parent():
    manager = make_manager()
    assert allocate_new(manager, "parent", 6)
    manager.fork("parent", "child", 6)
    assert manager.block_ids("child") == manager.block_ids("parent") == [0, 1]
    assert [manager.pool.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    assert manager.num_free_blocks == 6
    manager.check_invariants()


def test_forked_writes_diverge_through_copy_on_write():
    manager = make_manager()
    assert allocate_new(manager, "parent", 6)
    manager.fork("parent", "child", 6)
    # The parent writes token 6 into shared block 1: it gets a private copy first.
    assert manager.allocate_slots("parent", 1, 6)
    assert manager.block_ids("parent") == [0, 2]
    assert manager.take_block_copies() == [(1, 2)]
    assert manager.take_block_copies() == []
    # Block 1 is now the child's alone: the child writes in place, no copy.
    assert manager.allocate_slots("child", 1, 6)
    assert manager.block_ids("child") == [0, 1]
    assert manager.take_block_copies() == []
    assert [manager.pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    manager.check_invariants()


def test_writes_past_the_shared_blocks_need_no_copy():
    manager = make_manager()
    assert allocate_new(manager, "parent", 8)
    manager.fork("parent", "child", 8)
    assert manager.allocate_slots("parent", 1, 8)
    assert manager.block_ids("parent") == [0, 1, 2]
    assert manager.take_block_copies() == []
    manager.check_invariants()


def test_fork_then_free_both_returns_every_block():
    manager = make_manager()
    assert allocate_new(manager, "parent", 6)
    manager.fork("parent", "child", 6)
    assert manager.allocate_slots("parent", 3, 6)
    assert manager.allocate_slots("child", 5, 6)
    manager.free("parent")
    manager.check_invariants()
    manager.free("child")
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_copy_on_write_that_cannot_get_a_block_changes_nothing():
    manager = make_manager(num_blocks=2)
    assert allocate_new(manager, "parent", 6)
    manager.fork("parent", "child", 6)
    assert manager.num_free_blocks == 0
    before = manager_state(manager)
    assert manager.allocate_slots("parent", 1, 6) is False
    assert manager_state(manager) == before
    assert manager.take_block_copies() == []
    manager.check_invariants()


def test_copy_on_write_counts_its_copy_against_the_free_blocks():
    manager = make_manager(num_blocks=3)
    assert allocate_new(manager, "parent", 6)
    manager.fork("parent", "child", 6)
    # Tokens 6..9 write into shared block 1 (needs a copy) and a new block 2: two blocks, one free.
    before = manager_state(manager)
    assert manager.allocate_slots("parent", 4, 6) is False
    assert manager_state(manager) == before
    assert manager.allocate_slots("parent", 2, 6)
    assert manager.take_block_copies() == [(1, 2)]
    manager.check_invariants()


def test_fork_into_an_existing_request_is_refused():
    manager = make_manager()
    assert allocate_new(manager, "a", 4)
    assert allocate_new(manager, "b", 4)
    before = manager_state(manager)
    with pytest.raises(RuntimeError):
        manager.fork("a", "b", 4)
    assert manager_state(manager) == before
    manager.check_invariants()


def test_fork_shares_only_the_blocks_covering_the_given_tokens():
    manager = make_manager()
    assert allocate_new(manager, "parent", 10)
    manager.fork("parent", "child", 5)
    assert manager.block_ids("child") == [0, 1]
    assert [manager.pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    manager.check_invariants()


def test_fork_of_zero_tokens_gives_an_empty_table():
    manager = make_manager()
    assert allocate_new(manager, "parent", 6)
    manager.fork("parent", "child", 0)
    assert manager.block_ids("child") == []
    assert "child" in manager.tables
    assert manager.allocate_slots("child", 1, 0)
    assert manager.block_ids("child") == [2]
    manager.check_invariants()


def test_writing_into_a_cached_block_copies_it_even_when_unshared():
    manager = make_manager()
    run_prompt(manager, "parent", PROMPT[:9])  # blocks 0 and 1 cached, 2 holds token 8
    manager.fork("parent", "child", 6)  # the child's history ends inside cached block 1
    manager.free("parent")
    assert manager.pool.blocks[1].ref_count == 1
    assert manager.allocate_slots("child", 1, 6)
    assert manager.take_block_copies() == [(1, 2)]
    assert manager.block_ids("child") == [0, 2]
    # The cached block kept its content, so the parent's prefix still hits it.
    assert manager.allocate_cached_prefix("again", PROMPT[:9]) == 8
    assert manager.block_ids("again") == [0, 1]
    manager.check_invariants()


def test_child_that_diverges_inside_a_cached_block_caches_its_own_chain():
    manager = make_manager(num_blocks=10)
    parent_tokens = PROMPT[:9]
    run_prompt(manager, "parent", parent_tokens)  # blocks 0 and 1 cached
    manager.fork("parent", "child", 6)  # positions 6, 7 of block 1 will differ from the parent's
    child_tokens = parent_tokens[:6] + [7, 7] + [8, 8, 8, 8] + [9]
    assert manager.allocate_slots("child", 7, 6)
    assert manager.take_block_copies() == [(1, 3)]
    manager.cache_computed_blocks("child", child_tokens, 13)
    assert manager.block_ids("child") == [0, 3, 4, 5]
    # Block 4 was computed after the child's block 3, not after the parent's block 1.
    assert manager.allocate_cached_prefix("after-parent", parent_tokens[:8] + [8, 8, 8, 8, 0]) == 8
    assert manager.block_ids("after-parent") == [0, 1]
    assert manager.allocate_cached_prefix("after-child", child_tokens[:12] + [0]) == 12
    assert manager.block_ids("after-child") == [0, 3, 4]
    manager.check_invariants()


def test_forked_child_of_a_cached_prompt_keeps_sharing_the_cached_blocks():
    manager = make_manager()
    run_prompt(manager, "parent", PROMPT[:9])
    manager.fork("parent", "child", 9)
    manager.cache_computed_blocks("child", PROMPT[:9], 9)
    manager.free("parent")
    assert manager.block_ids("child") == [0, 1, 2]
    assert manager.allocate_cached_prefix("c", PROMPT[:9]) == 8
    manager.check_invariants()
