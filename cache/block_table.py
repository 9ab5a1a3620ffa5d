"""`BlockTable`: one request's logical -> physical block list, and the slot arithmetic.

A request's context is logically contiguous and physically paged:
    block = table[pos // block_size], offset = pos % block_size, slot = block * block_size + offset.
New K/V writes (slot mapping) and historical reads (block table rows) use the same mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A table entry whose block was released because it left a sliding window: never read again.
NULL_BLOCK = -1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class BlockTable:
    """The physical block ids of one request, in logical order."""

    block_size: int
    block_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def num_held_blocks(self) -> int:
        """Entries that hold a block (not released out of a sliding window)."""
        return sum(block_id != NULL_BLOCK for block_id in self.block_ids)

    @property
    def num_slots(self) -> int:
        """Tokens the reserved blocks can hold."""
        return len(self.block_ids) * self.block_size

    def resolve(self, pos: int) -> tuple[int, int]:
        """(physical block, offset) of logical position `pos`; IndexError if not reserved."""
        if pos < 0 or pos >= self.num_slots:
            raise IndexError(f"position {pos} is outside the {self.num_slots} reserved slots")
        return self.block_ids[pos // self.block_size], pos % self.block_size

    def slot(self, pos: int) -> int:
        block_id, offset = self.resolve(pos)
        return block_id * self.block_size + offset

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Flat KV slots of logical positions [start, end)."""
        if start < 0 or end > self.num_slots:
            raise IndexError(
                f"positions [{start}, {end}) exceed the {self.num_slots} reserved slots"
            )
        size, ids = self.block_size, self.block_ids
        return [ids[pos // size] * size + pos % size for pos in range(start, end)]

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Blocks to add so that positions [0, num_computed + num_new) have slots (never < 0)."""
        required = ceil_div(num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, required - len(self.block_ids))
