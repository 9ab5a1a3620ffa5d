"""`BlockManager.snapshot`: a plain copy of every block's ref count and hash flag and of every
block table, that later changes to the manager do not reach."""

from tests.cache.support import BLOCK_SIZE, make_manager, manager_state, run_prompt

PROMPT = list(range(100, 113))  # 13 tokens: three full blocks + one token


def test_snapshot_reports_shared_cached_and_free_blocks_with_exact_ids():
    manager = make_manager(num_blocks=8)
    run_prompt(manager, "a", PROMPT)  # blocks 0..3; 0..2 full and hashed
    assert run_prompt(manager, "b", PROMPT) == 3 * BLOCK_SIZE  # shares 0..2, own block 4
    manager.free("a")  # block 3 (a's tail, never full) goes back unhashed

    snapshot = manager.snapshot()

    assert snapshot.block_size == BLOCK_SIZE
    assert snapshot.num_blocks == 8
    assert snapshot.num_free_blocks == 4
    assert snapshot.enable_prefix_caching is True
    assert snapshot.ref_counts == [1, 1, 1, 0, 1, 0, 0, 0]
    assert snapshot.is_hashed == [True, True, True, False, False, False, False, False]
    assert snapshot.tables == {"b": [0, 1, 2, 4]}
    manager.check_invariants()


def test_snapshot_keeps_a_freed_prefix_as_hashed_blocks_with_no_references():
    manager = make_manager(num_blocks=8)
    run_prompt(manager, "a", PROMPT)
    manager.free("a")

    snapshot = manager.snapshot()

    assert snapshot.ref_counts == [0] * 8
    assert snapshot.is_hashed[:4] == [True, True, True, False]
    assert snapshot.tables == {}
    assert snapshot.num_free_blocks == 8


def test_snapshot_is_a_copy_that_later_allocations_do_not_change():
    manager = make_manager(num_blocks=8)
    run_prompt(manager, "a", PROMPT)
    run_prompt(manager, "b", PROMPT)
    snapshot = manager.snapshot()
    before = (dict(snapshot.tables), list(snapshot.ref_counts), list(snapshot.is_hashed))
    state = manager_state(manager)

    assert manager.allocate_slots("b", 4, len(PROMPT))
    manager.free("a")

    assert (snapshot.tables, snapshot.ref_counts, snapshot.is_hashed) == before
    assert snapshot.tables["b"] == [0, 1, 2, 4]
    assert manager_state(manager) != state  # the manager did change; the snapshot did not


def test_snapshot_mutates_nothing():
    manager = make_manager(num_blocks=8)
    run_prompt(manager, "a", PROMPT)
    state = manager_state(manager)
    manager.snapshot()
    assert manager_state(manager) == state
    manager.check_invariants()
