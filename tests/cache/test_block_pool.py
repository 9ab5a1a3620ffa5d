"""BlockPool: free queue, ref counts, LRU eviction and the prefix-cache hash index."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.cache.block_pool import Block, BlockPool, DoubleFreeError, OutOfBlocksError


def pool_state(pool: BlockPool) -> tuple:
    """Everything observable about a pool, to compare before and after a failed call."""
    return (
        pool.num_free_blocks,
        tuple(
            (b.block_id, b.ref_count, b.block_hash, b.parent_hash, b.token_ids) for b in pool.blocks
        ),
    )


def test_new_pool_has_every_block_free():
    pool = BlockPool(num_blocks=8)
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0
    assert all(b.ref_count == 0 and b.block_hash is None for b in pool.blocks)
    pool.check_invariants()


def test_pool_rejects_zero_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0)


def test_allocate_takes_blocks_in_id_order_with_ref_count_one():
    pool = BlockPool(num_blocks=8)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)
    pool.check_invariants()


def test_allocate_zero_blocks_returns_nothing_and_changes_nothing():
    pool = BlockPool(num_blocks=4)
    before = pool_state(pool)
    assert pool.allocate(0) == []
    assert pool_state(pool) == before
    pool.check_invariants()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(num_blocks=4)
    pool.allocate(3)
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool_state(pool) == before
    pool.check_invariants()


def test_release_to_zero_returns_the_block_to_the_free_queue():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.allocate(1)
    pool.touch(block)
    assert block.ref_count == 2
    pool.release(block)
    assert block.ref_count == 1
    assert pool.num_free_blocks == 3
    pool.release(block)
    assert block.ref_count == 0
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_double_release_raises_double_free_error_and_changes_nothing():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.allocate(1)
    pool.release(block)
    before = pool_state(pool)
    with pytest.raises(DoubleFreeError):
        pool.release(block)
    assert pool_state(pool) == before
    pool.check_invariants()


def test_release_of_a_never_allocated_block_raises_double_free_error():
    pool = BlockPool(num_blocks=4)
    with pytest.raises(DoubleFreeError):
        pool.release(pool.blocks[2])
    pool.check_invariants()


def test_double_free_error_is_a_runtime_error():
    assert issubclass(DoubleFreeError, RuntimeError)
    assert issubclass(OutOfBlocksError, RuntimeError)


def test_hashless_blocks_are_reused_before_cached_ones():
    pool = BlockPool(num_blocks=3)
    cached, plain, _ = pool.allocate(3)
    pool.cache(cached, block_hash=11, parent_hash=0, token_ids=(1, 2))
    pool.release(cached)
    pool.release(plain)
    # `plain` was freed last but carries nothing worth keeping, so it goes first.
    (reused,) = pool.allocate(1)
    assert reused is plain
    assert pool.lookup(11, 0, (1, 2)) is cached
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(num_blocks=3)
    first, second, third = pool.allocate(3)
    for block_hash, block in ((1, first), (2, second), (3, third)):
        pool.cache(block, block_hash, parent_hash=0, token_ids=(block_hash,))
    for block in (second, third, first):
        pool.release(block)
    assert [b.block_id for b in pool.allocate(2)] == [second.block_id, third.block_id]
    assert pool.lookup(2, 0, (2,)) is None
    assert pool.lookup(3, 0, (3,)) is None
    assert pool.lookup(1, 0, (1,)) is first
    pool.check_invariants()


def test_eviction_clears_the_hash_of_the_reused_block():
    pool = BlockPool(num_blocks=1)
    (block,) = pool.allocate(1)
    pool.cache(block, block_hash=5, parent_hash=0, token_ids=(1, 2))
    pool.release(block)
    (reused,) = pool.allocate(1)
    assert reused is block
    assert (block.block_hash, block.parent_hash, block.token_ids) == (None, None, ())
    assert pool.lookup(5, 0, (1, 2)) is None
    pool.check_invariants()


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(num_blocks=2)
    (block,) = pool.allocate(1)
    pool.cache(block, block_hash=9, parent_hash=0, token_ids=(4,))
    pool.release(block)
    assert pool.num_free_blocks == 2
    hit = pool.lookup(9, 0, (4,))
    assert hit is block
    pool.touch(hit)
    assert block.ref_count == 1
    assert pool.num_free_blocks == 1
    # The revived block is no longer in the free queue: the next allocation takes the other one.
    (other,) = pool.allocate(1)
    assert other is not block
    pool.check_invariants()


def test_touch_of_a_referenced_block_only_adds_a_reference():
    pool = BlockPool(num_blocks=2)
    (block,) = pool.allocate(1)
    pool.touch(block)
    assert block.ref_count == 2
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_lookup_requires_the_same_parent_and_tokens():
    pool = BlockPool(num_blocks=2)
    (block,) = pool.allocate(1)
    pool.cache(block, block_hash=42, parent_hash=7, token_ids=[1, 2, 3])
    assert pool.lookup(42, 7, [1, 2, 3]) is block
    assert pool.lookup(42, 8, [1, 2, 3]) is None
    assert pool.lookup(42, 7, [1, 2, 4]) is None
    assert pool.lookup(43, 7, [1, 2, 3]) is None
    pool.check_invariants()


def test_cache_keeps_the_first_block_registered_under_a_hash():
    pool = BlockPool(num_blocks=2)
    first, second = pool.allocate(2)
    pool.cache(first, 42, 0, (1,))
    pool.cache(second, 42, 0, (1,))
    assert pool.lookup(42, 0, (1,)) is first
    assert second.block_hash is None
    pool.check_invariants()


def test_cache_does_not_rehash_a_block_that_already_has_a_hash():
    pool = BlockPool(num_blocks=1)
    (block,) = pool.allocate(1)
    pool.cache(block, 42, 0, (1,))
    pool.cache(block, 43, 0, (2,))
    assert block.block_hash == 42
    assert pool.lookup(43, 0, (2,)) is None
    pool.check_invariants()


def test_cache_is_a_no_op_when_prefix_caching_is_off():
    pool = BlockPool(num_blocks=2, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    pool.cache(block, 42, 0, (1,))
    assert block.block_hash is None
    assert pool.lookup(42, 0, (1,)) is None
    pool.check_invariants()


def test_free_releases_each_block_once_in_the_given_order():
    pool = BlockPool(num_blocks=3)
    blocks = pool.allocate(3)
    for block_hash, block in enumerate(blocks, start=1):
        pool.cache(block, block_hash, 0, (block_hash,))
    pool.free(reversed(blocks))  # tail first: the tail is evicted first
    assert pool.num_free_blocks == 3
    assert [b.block_id for b in pool.allocate(3)] == [2, 1, 0]
    pool.check_invariants()


def test_check_invariants_reports_a_corrupted_ref_count():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.allocate(1)
    block.ref_count = 0  # simulate a bug: released without going back to the free queue
    with pytest.raises(RuntimeError, match="free 3"):
        pool.check_invariants()


def test_check_invariants_reports_a_negative_ref_count():
    pool = BlockPool(num_blocks=2)
    pool.blocks[0].ref_count = -1
    with pytest.raises(RuntimeError):
        pool.check_invariants()


def test_check_invariants_reports_a_referenced_block_in_the_free_queue():
    pool = BlockPool(num_blocks=2)
    (block,) = pool.allocate(1)
    pool.blocks[1].ref_count = 1  # the free queue still holds block 1
    block.ref_count = 0
    with pytest.raises(RuntimeError):
        pool.check_invariants()


def test_block_identity_not_value_decides_equality():
    assert Block(0) != Block(0)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(min_value=1, max_value=8),
    operations=st.lists(
        st.tuples(st.sampled_from(["allocate", "touch", "release"]), st.integers(0, 9)),
        max_size=40,
    ),
)
def test_ref_counts_and_free_count_agree_after_any_operation_sequence(num_blocks, operations):
    pool = BlockPool(num_blocks)
    expected_refs = [0] * num_blocks
    for operation, arg in operations:
        if operation == "allocate":
            before = pool_state(pool)
            if arg > pool.num_free_blocks:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(arg)
                assert pool_state(pool) == before
            else:
                for block in pool.allocate(arg):
                    assert expected_refs[block.block_id] == 0, "allocated a referenced block"
                    expected_refs[block.block_id] = 1
        else:
            block = pool.blocks[arg % num_blocks]
            if operation == "touch" and expected_refs[block.block_id] > 0:
                pool.touch(block)
                expected_refs[block.block_id] += 1
            elif operation == "release" and expected_refs[block.block_id] > 0:
                pool.release(block)
                expected_refs[block.block_id] -= 1
            elif operation == "release":
                with pytest.raises(DoubleFreeError):
                    pool.release(block)
        assert [b.ref_count for b in pool.blocks] == expected_refs
        assert pool.num_free_blocks == expected_refs.count(0)
        pool.check_invariants()


def test_reset_prefix_cache_forgets_every_cached_block_only_while_none_is_referenced():
    pool = BlockPool(num_blocks=3)
    first, second = pool.allocate(2)
    pool.cache(first, 1, None, (1,))
    pool.cache(second, 2, 1, (2,))
    pool.release(first)
    assert not pool.reset_prefix_cache()  # `second` is still referenced: nothing changes
    assert pool.lookup(1, None, (1,)) is first and pool.lookup(2, 1, (2,)) is second
    pool.release(second)
    assert pool.reset_prefix_cache()
    assert pool.lookup(1, None, (1,)) is None and pool.lookup(2, 1, (2,)) is None
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.num_free_blocks == 3
    pool.check_invariants()
    assert len(pool.allocate(3)) == 3
