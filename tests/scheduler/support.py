"""Helpers shared by the scheduler unit tests."""


def ref_counts(scheduler):
    return [block.ref_count for block in scheduler.block_manager.pool.blocks]
