"""BlockManager: all-or-nothing growth, prefix caching, fork and copy-on-write, with exact block ids."""

from collections.abc import Sequence

import pytest

from cache.block_manager import BlockManager
from cache.block_pool import DoubleFreeError

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


def fill_with_single_block_requests(manager: BlockManager) -> None:
    """Give request f<i> block i for every block of the pool."""
    for block_id in range(manager.pool.num_blocks):
        assert manager.allocate_slots(f"f{block_id}", BLOCK_SIZE, 0)
        assert manager.block_ids(f"f{block_id}") == [block_id]


# --- growth: the worked example and all-or-nothing reservation -------------------------------


def make_worked_example() -> BlockManager:
    """Block size 4, request "a" holding table [7, 2, 9] and 12 computed tokens; pool empty."""
    manager = make_manager(num_blocks=10)
    fill_with_single_block_requests(manager)
    for request_id in ("f9", "f2", "f7"):  # hash-less blocks go to the front of the free queue
        manager.free(request_id)
    assert manager.allocate_slots("a", 12, 0)
    assert manager.block_ids("a") == [7, 2, 9]
    return manager


def test_worked_example_resolves_tokens_through_the_table():
    manager = make_worked_example()
    table = manager.get_table("a")
    assert table.resolve(0) == (7, 0)
    assert table.resolve(5) == (2, 1)
    assert table.resolve(10) == (9, 2)
    assert manager.num_free_blocks == 0
    manager.check_invariants()


def test_failed_allocation_does_not_advance_length():
    manager = make_worked_example()
    before = manager_state(manager)
    # Token 12 needs a fourth block, and the pool is empty.
    assert manager.allocate_slots("a", 1, 12) is False
    assert manager_state(manager) == before
    assert manager.get_table("a").num_slots == 12
    assert manager.take_block_copies() == []
    manager.check_invariants()


def test_writing_token_twelve_reserves_a_fourth_block_once_one_is_free():
    manager = make_worked_example()
    manager.free("f0")
    assert manager.allocate_slots("a", 1, 12)
    assert manager.block_ids("a") == [7, 2, 9, 0]
    assert manager.get_table("a").resolve(12) == (0, 0)
    assert manager.get_table("a").slot(12) == 0
    manager.check_invariants()


def test_allocation_within_reserved_slots_needs_no_new_block():
    manager = make_manager()
    assert manager.allocate_slots("a", 5, 0)
    assert manager.block_ids("a") == [0, 1]
    assert manager.allocate_slots("a", 3, 5)
    assert manager.block_ids("a") == [0, 1]
    assert manager.num_free_blocks == 6
    manager.check_invariants()


def test_allocation_grows_by_exactly_the_blocks_the_step_needs():
    manager = make_manager()
    assert manager.allocate_slots("a", 1, 0)
    assert manager.block_ids("a") == [0]
    assert manager.allocate_slots("a", 9, 1)
    assert manager.block_ids("a") == [0, 1, 2]
    manager.check_invariants()


def test_failed_first_allocation_creates_no_table():
    manager = make_manager(num_blocks=2)
    before = manager_state(manager)
    assert manager.allocate_slots("a", 9, 0) is False
    assert "a" not in manager.tables
    assert manager.block_ids("a") == []
    assert manager_state(manager) == before
    manager.check_invariants()


def test_failed_allocation_after_a_cache_miss_keeps_the_empty_table():
    manager = make_manager(num_blocks=2)
    assert manager.allocate_cached_prefix("a", list(range(9))) == 0
    before = manager_state(manager)
    assert manager.allocate_slots("a", 9, 0) is False
    assert manager_state(manager) == before
    manager.check_invariants()


def test_allocation_after_a_cache_miss_fills_the_requests_own_table():
    manager = make_manager()
    assert manager.allocate_cached_prefix("a", list(range(6))) == 0
    assert manager.allocate_slots("a", 6, 0)
    assert manager.block_ids("a") == [0, 1]
    manager.check_invariants()


def test_allocation_uses_up_the_whole_pool_then_fails():
    manager = make_manager(num_blocks=3)
    assert manager.allocate_slots("a", 12, 0)
    assert manager.num_free_blocks == 0
    before = manager_state(manager)
    assert manager.allocate_slots("b", 1, 0) is False
    assert manager_state(manager) == before
    manager.check_invariants()


def test_request_that_can_never_fit_is_reported():
    manager = make_manager(num_blocks=8)
    assert manager.can_ever_fit(32)
    assert not manager.can_ever_fit(33)
    assert manager.can_ever_fit(0)
    manager.check_invariants()


def test_can_ever_fit_ignores_blocks_in_use_now():
    manager = make_manager(num_blocks=2)
    assert manager.allocate_slots("a", 8, 0)
    assert manager.can_ever_fit(8)
    assert manager.allocate_slots("b", 1, 0) is False
    manager.check_invariants()


# --- free --------------------------------------------------------------------------------------


def test_free_returns_every_block_and_forgets_the_table():
    manager = make_manager()
    assert manager.allocate_slots("a", 10, 0)
    manager.free("a")
    assert manager.num_free_blocks == 8
    assert "a" not in manager.tables
    manager.check_invariants()


def test_free_of_an_unknown_request_is_a_no_op():
    manager = make_manager()
    assert manager.allocate_slots("a", 4, 0)
    before = manager_state(manager)
    manager.free("missing")
    manager.free("missing")
    assert manager_state(manager) == before
    manager.check_invariants()


def test_releasing_a_freed_block_again_raises_double_free_error():
    manager = make_manager()
    assert manager.allocate_slots("a", 4, 0)
    (block_id,) = manager.block_ids("a")
    manager.free("a")
    with pytest.raises(DoubleFreeError):
        manager.pool.release(manager.pool.blocks[block_id])
    manager.check_invariants()


def test_check_invariants_reports_a_leaked_reference():
    manager = make_manager()
    assert manager.allocate_slots("a", 4, 0)
    manager.pool.touch(manager.pool.blocks[0])  # a reference no table accounts for
    with pytest.raises(RuntimeError, match="block 0"):
        manager.check_invariants()


# --- prefix caching ----------------------------------------------------------------------------

PROMPT = list(range(100, 113))  # 13 tokens: three full blocks + one token


def test_requests_sharing_a_three_block_prefix_share_the_physical_blocks():
    manager = make_manager()
    assert run_prompt(manager, "a", PROMPT) == 0
    assert manager.block_ids("a") == [0, 1, 2, 3]
    assert run_prompt(manager, "b", PROMPT[:12] + [7, 7, 7, 7]) == 12
    assert manager.block_ids("b") == [0, 1, 2, 4]
    assert [manager.pool.blocks[i].ref_count for i in range(5)] == [2, 2, 2, 1, 1]
    manager.check_invariants()


def test_prefix_hit_survives_the_original_request_being_freed():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT)
    manager.free("a")
    assert manager.allocate_cached_prefix("b", PROMPT) == 12
    assert manager.block_ids("b") == [0, 1, 2]
    assert manager.num_free_blocks == 5
    manager.check_invariants()


def test_partial_last_block_is_never_shared_by_hash():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT[:6])  # block 1 holds only 2 tokens
    assert manager.pool.blocks[0].block_hash is not None
    assert manager.pool.blocks[1].block_hash is None
    assert manager.allocate_cached_prefix("b", PROMPT[:6] + [1, 2, 3]) == 4
    assert manager.block_ids("b") == [0]
    manager.check_invariants()


def test_block_holding_the_prompts_last_token_is_never_a_hit():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT[:8])
    assert all(manager.pool.blocks[i].block_hash is not None for i in (0, 1))
    # Both blocks are cached, but block 1 holds the last token, whose logits must be computed.
    assert manager.allocate_cached_prefix("b", PROMPT[:8]) == 4
    assert manager.block_ids("b") == [0]
    assert manager.allocate_slots("b", 4, 4)
    assert manager.block_ids("b") == [0, 2]
    manager.check_invariants()


def test_one_token_prompt_is_never_a_hit():
    manager = make_manager()
    run_prompt(manager, "a", [5])
    assert manager.allocate_cached_prefix("b", [5]) == 0
    manager.check_invariants()


def test_prompt_one_token_past_a_cached_prefix_hits_every_full_block():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT[:8])
    assert manager.allocate_cached_prefix("b", PROMPT[:9]) == 8
    assert manager.block_ids("b") == [0, 1]
    manager.check_invariants()


def test_prefix_hit_stops_at_the_first_differing_block():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT)
    changed = PROMPT[:4] + [0] + PROMPT[5:]
    assert manager.allocate_cached_prefix("b", changed) == 4
    manager.check_invariants()


def test_same_block_after_a_different_prefix_is_not_a_hit():
    manager = make_manager()
    run_prompt(manager, "a", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    assert manager.allocate_cached_prefix("b", [3, 3, 3, 3, 2, 2, 2, 2, 9]) == 0
    manager.check_invariants()


def test_different_extra_keys_do_not_share_blocks():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT, extra_key="lora-1")
    assert manager.allocate_cached_prefix("b", PROMPT, extra_key="lora-2") == 0
    assert manager.allocate_cached_prefix("c", PROMPT, extra_key="lora-1") == 12
    manager.check_invariants()


def test_eviction_is_least_recently_used():
    manager = make_manager(num_blocks=6)
    prompt_a, prompt_b = [1] * 8, [2] * 8
    run_prompt(manager, "a", prompt_a)
    run_prompt(manager, "b", prompt_b)
    assert manager.block_ids("a") == [0, 1]
    assert manager.block_ids("b") == [2, 3]
    manager.free("a")
    manager.free("b")
    # Four blocks: the two never used, then A's (freed first), not B's.
    assert manager.allocate_slots("c", 16, 0)
    assert sorted(manager.block_ids("c")) == [0, 1, 4, 5]
    assert manager.allocate_cached_prefix("a2", prompt_a + [0]) == 0
    assert manager.allocate_cached_prefix("b2", prompt_b + [0]) == 8
    assert manager.block_ids("b2") == [2, 3]
    manager.check_invariants()


def test_freed_table_tail_is_evicted_before_its_head():
    manager = make_manager(num_blocks=3)
    run_prompt(manager, "a", [1] * 12)
    manager.free("a")
    assert manager.allocate_slots("c", 4, 0)
    assert manager.block_ids("c") == [2]
    # The head of the chain survives: a shorter prefix still hits.
    assert manager.allocate_cached_prefix("b", [1] * 9) == 8
    manager.check_invariants()


def test_recently_hit_prefix_is_kept_over_an_older_one():
    manager = make_manager(num_blocks=4)
    prompt_a, prompt_b = [1] * 8, [2] * 8
    run_prompt(manager, "a", prompt_a)
    run_prompt(manager, "b", prompt_b)
    manager.free("a")
    manager.free("b")
    run_prompt(manager, "a2", prompt_a + [5])  # revives A's blocks, then frees them after B's
    manager.free("a2")
    assert manager.allocate_slots("c", 4, 0)
    assert manager.allocate_cached_prefix("a3", prompt_a + [5]) == 8
    assert manager.allocate_cached_prefix("b3", prompt_b + [5]) == 4
    manager.check_invariants()


def test_prefix_caching_off_gives_no_hits_and_no_hashes():
    manager = make_manager(enable_prefix_caching=False)
    run_prompt(manager, "a", PROMPT)
    assert manager.block_ids("a") == [0, 1, 2, 3]
    assert run_prompt(manager, "b", PROMPT) == 0
    assert manager.block_ids("b") == [4, 5, 6, 7]
    assert all(b.block_hash is None for b in manager.pool.blocks)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    manager.check_invariants()


def test_prefix_cache_counters_count_queried_and_hit_tokens():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (13, 0)
    run_prompt(manager, "b", PROMPT[:9])
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (22, 8)
    manager.check_invariants()


def test_cache_computed_blocks_registers_only_computed_full_blocks():
    manager = make_manager()
    assert manager.allocate_cached_prefix("a", PROMPT) == 0
    assert manager.allocate_slots("a", 13, 0)
    manager.cache_computed_blocks("a", PROMPT, 5)  # a chunked prefill: only 5 tokens computed
    hashed = [manager.pool.blocks[i].block_hash is not None for i in manager.block_ids("a")]
    assert hashed == [True, False, False, False]
    manager.cache_computed_blocks("a", PROMPT, 13)
    hashed = [manager.pool.blocks[i].block_hash is not None for i in manager.block_ids("a")]
    assert hashed == [True, True, True, False]
    manager.check_invariants()


def test_identical_prompts_computed_concurrently_keep_one_cached_copy():
    manager = make_manager()
    for request_id in ("a", "b"):
        assert manager.allocate_cached_prefix(request_id, PROMPT[:9]) == 0
        assert manager.allocate_slots(request_id, 9, 0)
    for request_id in ("a", "b"):
        manager.cache_computed_blocks(request_id, PROMPT[:9], 9)
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.block_ids("b") == [3, 4, 5]
    assert manager.allocate_cached_prefix("c", PROMPT[:9]) == 8
    assert manager.block_ids("c") == [0, 1]
    manager.check_invariants()


def test_second_table_for_the_same_request_is_refused():
    manager = make_manager()
    manager.allocate_cached_prefix("a", PROMPT)
    with pytest.raises(RuntimeError):
        manager.allocate_cached_prefix("a", PROMPT)
    manager.check_invariants()


# --- fork and copy-on-write -----------------------------------------------------------------


def test_fork_shares_every_block_of_the_parent():
    manager = make_manager()
    assert manager.allocate_slots("parent", 6, 0)
    manager.fork("parent", "child", 6)
    assert manager.block_ids("child") == manager.block_ids("parent") == [0, 1]
    assert [manager.pool.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    assert manager.num_free_blocks == 6
    manager.check_invariants()


def test_forked_writes_diverge_through_copy_on_write():
    manager = make_manager()
    assert manager.allocate_slots("parent", 6, 0)
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
    assert manager.allocate_slots("parent", 8, 0)
    manager.fork("parent", "child", 8)
    assert manager.allocate_slots("parent", 1, 8)
    assert manager.block_ids("parent") == [0, 1, 2]
    assert manager.take_block_copies() == []
    manager.check_invariants()


def test_fork_then_free_both_returns_every_block():
    manager = make_manager()
    assert manager.allocate_slots("parent", 6, 0)
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
    assert manager.allocate_slots("parent", 6, 0)
    manager.fork("parent", "child", 6)
    assert manager.num_free_blocks == 0
    before = manager_state(manager)
    assert manager.allocate_slots("parent", 1, 6) is False
    assert manager_state(manager) == before
    assert manager.take_block_copies() == []
    manager.check_invariants()


def test_copy_on_write_counts_its_copy_against_the_free_blocks():
    manager = make_manager(num_blocks=3)
    assert manager.allocate_slots("parent", 6, 0)
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
    assert manager.allocate_slots("a", 4, 0)
    assert manager.allocate_slots("b", 4, 0)
    before = manager_state(manager)
    with pytest.raises(RuntimeError):
        manager.fork("a", "b", 4)
    assert manager_state(manager) == before
    manager.check_invariants()


def test_fork_shares_only_the_blocks_covering_the_given_tokens():
    manager = make_manager()
    assert manager.allocate_slots("parent", 10, 0)
    manager.fork("parent", "child", 5)
    assert manager.block_ids("child") == [0, 1]
    assert [manager.pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    manager.check_invariants()


def test_fork_of_zero_tokens_gives_an_empty_table():
    manager = make_manager()
    assert manager.allocate_slots("parent", 6, 0)
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


# --- regression: Python's hash() collides (hash(-1) == hash(-2)); the chain must not --------


def test_prefix_hit_never_serves_a_block_computed_after_a_colliding_parent():
    assert hash(-1) == hash(-2)  # the collision a hash()-based chain would fall for
    manager = make_manager()
    run_prompt(manager, "b", [-2, 0, 0, 0, 1])  # block 0 is cached under h0
    # "a" misses block 0 (other tokens) and caches block 3 with parent hash h0.
    run_prompt(manager, "a", [-1, 0, 0, 0, 5, 5, 5, 5, 9])
    assert manager.block_ids("a") == [2, 3, 4]
    # Block 3's K/V were computed after [-1, 0, 0, 0]; "c" must not reuse it after [-2, 0, 0, 0].
    num_cached_tokens = manager.allocate_cached_prefix("c", [-2, 0, 0, 0, 5, 5, 5, 5, 9])
    assert 3 not in manager.block_ids("c")[:2], f"hit {num_cached_tokens} tokens on block 3"
    manager.check_invariants()
