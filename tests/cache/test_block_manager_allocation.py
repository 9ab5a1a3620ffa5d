"""BlockManager allocation, with exact block ids: the worked example of a table resolving tokens,
all-or-nothing growth (a failed call changes nothing), whether a request can ever fit, and freeing
(every block comes back; a double free or a leaked reference is reported)."""

import pytest

from pagedserve.cache.block_manager import BlockManager
from pagedserve.cache.block_pool import DoubleFreeError
from tests.cache.support import (
    allocate_new,
    fill_with_single_block_requests,
    make_manager,
    manager_state,
)

# --- growth: the worked example and all-or-nothing reservation -------------------------------


def make_worked_example() -> BlockManager:
    """Block size 4, request "a" holding table [7, 2, 9] and 12 computed tokens; pool empty."""
    manager = make_manager(num_blocks=10)
    fill_with_single_block_requests(manager)
    for request_id in ("f9", "f2", "f7"):  # hash-less blocks go to the front of the free queue
        manager.free(request_id)
    assert allocate_new(manager, "a", 12)
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
    assert allocate_new(manager, "a", 5)
    assert manager.block_ids("a") == [0, 1]
    assert manager.allocate_slots("a", 3, 5)
    assert manager.block_ids("a") == [0, 1]
    assert manager.num_free_blocks == 6
    manager.check_invariants()


def test_allocation_grows_by_exactly_the_blocks_the_step_needs():
    manager = make_manager()
    assert allocate_new(manager, "a", 1)
    assert manager.block_ids("a") == [0]
    assert manager.allocate_slots("a", 9, 1)
    assert manager.block_ids("a") == [0, 1, 2]
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
    assert allocate_new(manager, "a", 12)
    assert manager.num_free_blocks == 0
    before = manager_state(manager)
    assert allocate_new(manager, "b", 1) is False
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
    assert allocate_new(manager, "a", 8)
    assert manager.can_ever_fit(8)
    assert allocate_new(manager, "b", 1) is False
    manager.check_invariants()


# --- free --------------------------------------------------------------------------------------


def test_free_returns_every_block_and_forgets_the_table():
    manager = make_manager()
    assert allocate_new(manager, "a", 10)
    manager.free("a")
    assert manager.num_free_blocks == 8
    assert "a" not in manager.tables
    manager.check_invariants()


def test_free_of_an_unknown_request_is_a_no_op():
    manager = make_manager()
    assert allocate_new(manager, "a", 4)
    before = manager_state(manager)
    manager.free("missing")
    manager.free("missing")
    assert manager_state(manager) == before
    manager.check_invariants()


def test_releasing_a_freed_block_again_raises_double_free_error():
    manager = make_manager()
    assert allocate_new(manager, "a", 4)
    (block_id,) = manager.block_ids("a")
    manager.free("a")
    with pytest.raises(DoubleFreeError):
        manager.pool.release(manager.pool.blocks[block_id])
    manager.check_invariants()


def test_check_invariants_reports_a_leaked_reference():
    manager = make_manager()
    assert allocate_new(manager, "a", 4)
    manager.pool.touch(manager.pool.blocks[0])  # a reference no table accounts for
    with pytest.raises(RuntimeError, match="block 0"):
        manager.check_invariants()
