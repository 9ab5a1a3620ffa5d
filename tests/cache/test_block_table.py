"""BlockTable: logical position -> (physical block, offset) -> flat KV slot, and growth arithmetic."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.cache.block_table import BlockTable, ceil_div


def make_worked_example_table() -> BlockTable:
    """The issue's worked example: block size 4, table [7, 2, 9]."""
    return BlockTable(block_size=4, block_ids=[7, 2, 9])


def test_resolve_maps_token_positions_of_the_worked_example():
    table = make_worked_example_table()
    assert table.resolve(0) == (7, 0)
    assert table.resolve(5) == (2, 1)
    assert table.resolve(10) == (9, 2)
    assert table.resolve(11) == (9, 3)


def test_slot_is_block_times_block_size_plus_offset():
    table = make_worked_example_table()
    assert table.slot(0) == 28
    assert table.slot(5) == 9
    assert table.slot(10) == 38


def test_resolve_past_the_reserved_slots_raises_index_error():
    table = make_worked_example_table()
    with pytest.raises(IndexError):
        table.resolve(12)
    with pytest.raises(IndexError):
        table.slot(12)


def test_resolve_of_negative_position_raises_index_error():
    with pytest.raises(IndexError):
        make_worked_example_table().resolve(-1)


def test_writing_token_twelve_needs_exactly_one_more_block():
    table = make_worked_example_table()
    assert table.num_slots == 12
    assert table.num_blocks_needed(num_computed_tokens=12, num_new_tokens=1) == 1
    # Reserving is the manager's job: the table itself is unchanged by asking.
    assert table.block_ids == [7, 2, 9]


def test_num_blocks_needed_is_zero_while_the_reserved_blocks_suffice():
    table = make_worked_example_table()
    assert table.num_blocks_needed(num_computed_tokens=0, num_new_tokens=12) == 0
    assert table.num_blocks_needed(num_computed_tokens=11, num_new_tokens=1) == 0
    assert table.num_blocks_needed(num_computed_tokens=0, num_new_tokens=0) == 0


def test_num_blocks_needed_for_an_empty_table_rounds_up():
    table = BlockTable(block_size=4)
    assert table.num_blocks_needed(0, 1) == 1
    assert table.num_blocks_needed(0, 4) == 1
    assert table.num_blocks_needed(0, 5) == 2
    assert table.num_blocks_needed(3, 6) == 3


def test_slot_mapping_lists_the_slots_of_a_position_range():
    table = make_worked_example_table()
    assert table.slot_mapping(2, 7) == [30, 31, 8, 9, 10]
    assert table.slot_mapping(4, 4) == []


def test_slot_mapping_past_the_reserved_slots_raises_index_error():
    with pytest.raises(IndexError):
        make_worked_example_table().slot_mapping(10, 13)


def test_empty_table_has_no_slots():
    table = BlockTable(block_size=16)
    assert len(table) == 0
    assert table.num_slots == 0
    with pytest.raises(IndexError):
        table.resolve(0)


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=512))
def test_ceil_div_is_the_smallest_count_that_covers(num_items, divisor):
    result = ceil_div(num_items, divisor)
    assert result * divisor >= num_items
    assert (result - 1) * divisor < num_items or result == 0


@given(
    block_size=st.integers(min_value=1, max_value=8),
    block_ids=st.lists(st.integers(min_value=0, max_value=63), min_size=1, max_size=8, unique=True),
    data=st.data(),
)
def test_every_reserved_position_maps_to_a_distinct_slot_in_its_block(block_size, block_ids, data):
    table = BlockTable(block_size, list(block_ids))
    slots = table.slot_mapping(0, table.num_slots)
    assert len(set(slots)) == len(slots)
    pos = data.draw(st.integers(min_value=0, max_value=table.num_slots - 1))
    block_id, offset = table.resolve(pos)
    assert block_id == block_ids[pos // block_size]
    assert 0 <= offset < block_size
    assert table.slot(pos) == slots[pos] == block_id * block_size + offset


@given(
    block_size=st.integers(min_value=1, max_value=8),
    num_blocks=st.integers(min_value=0, max_value=8),
    num_computed_tokens=st.integers(min_value=0, max_value=80),
    num_new_tokens=st.integers(min_value=0, max_value=80),
)
def test_num_blocks_needed_covers_exactly_the_new_positions(
    block_size, num_blocks, num_computed_tokens, num_new_tokens
):
    table = BlockTable(block_size, list(range(num_blocks)))
    needed = table.num_blocks_needed(num_computed_tokens, num_new_tokens)
    assert needed >= 0
    total_blocks = num_blocks + needed
    end = num_computed_tokens + num_new_tokens
    assert total_blocks * block_size >= end
    # Never over-reserves: one block fewer would not cover the range (unless nothing was needed).
    assert needed == 0 or (total_blocks - 1) * block_size < end
