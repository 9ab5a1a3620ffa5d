"""`EngineState`: what the block pool and the scheduler look like between two steps.

`AsyncEngine` takes a `RawEngineState` on the engine thread (the only thread that may read the
bookkeeping): flat copies only. `build_engine_state` classifies the blocks and finds their owners
on the caller's thread, so the engine thread pays only for the copy. Plain dataclasses: the server
turns them into JSON without importing `scheduler` or `cache`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.cache.block_manager import BlockManagerSnapshot
from pagedserve.engine.errors import RequestFailedError
from pagedserve.engine.outputs import EngineStats
from pagedserve.scheduler import Scheduler, SchedulerOutput
from pagedserve.scheduler.snapshot import (
    PlanSnapshot,
    RequestSnapshot,
    SchedulerSnapshot,
    snapshot_plan,
    snapshot_scheduler,
)

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# A block is "free" (nothing in it worth keeping), "cached" (free, but its hash is registered:
# a request with the same prefix revives it instead of recomputing) or "in_use" (ref_count > 0).
BLOCK_STATES = ("free", "cached", "in_use")
_NO_OWNERS: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block of an `EngineState`, as `EngineState.blocks()` lists them."""

    block_id: int
    state: str  # one of BLOCK_STATES
    ref_count: int
    owner_ids: Sequence[str]  # sequences whose block table holds this block (len == ref_count)
    is_hashed: bool  # registered in the prefix-cache index


@dataclass(frozen=True, slots=True)
class EngineState:
    """A consistent picture of the engine at one instant (taken between two steps).

    The pool is columnar (each list indexed by block id): the server polls this twice a second,
    and one object per block would cost more than the snapshot itself. `blocks()` gives the
    per-block view.
    """

    time: float  # Unix time of the snapshot
    num_steps: int  # non-empty steps run so far
    block_size: int
    num_blocks: int
    num_free_blocks: int  # free + cached
    enable_prefix_caching: bool
    block_states: list[str]  # one of BLOCK_STATES
    ref_counts: list[int]
    owner_ids: list[Sequence[str]]  # sequences whose block table holds it (len == ref_count)
    is_hashed: list[bool]  # registered in the prefix-cache index
    running: list[RequestSnapshot]
    waiting: list[RequestSnapshot]
    last_plan: PlanSnapshot | None
    stats: EngineStats

    def blocks(self) -> list[BlockInfo]:
        return [
            BlockInfo(block_id, *entry)
            for block_id, entry in enumerate(
                zip(self.block_states, self.ref_counts, self.owner_ids, self.is_hashed, strict=True)
            )
        ]


@dataclass(frozen=True, slots=True)
class RawEngineState:
    """The engine thread's share of a snapshot: copies only, no per-block objects."""

    time: float
    num_steps: int
    blocks: BlockManagerSnapshot
    scheduler: SchedulerSnapshot
    last_plan: PlanSnapshot | None  # None before the first step
    stats: EngineStats


def take_raw_state(
    scheduler: Scheduler, last_plan: SchedulerOutput | None, num_steps: int, stats: EngineStats
) -> RawEngineState:
    """Copy the bookkeeping (the scheduler's and its block manager's). Call on the engine thread."""
    token_budget = scheduler.config.max_num_batched_tokens
    return RawEngineState(
        time=time.time(),
        num_steps=num_steps,
        blocks=scheduler.block_manager.snapshot(),
        scheduler=snapshot_scheduler(scheduler),
        last_plan=None if last_plan is None else snapshot_plan(last_plan, token_budget),
        stats=stats,
    )


def take_engine_state(engine: LLMEngine) -> RawEngineState:
    """`take_raw_state` of `engine`. A failure (a bug) must not stop serving: it is logged and
    raised as a RequestFailedError, whose message names only its type."""
    try:
        return take_raw_state(engine.scheduler, engine.last_plan, engine.num_steps, engine.stats())
    except Exception as error:  # noqa: BLE001
        logger.exception("engine state snapshot failed")
        raise RequestFailedError(
            f"The engine state snapshot failed ({type(error).__name__})."
        ) from None


def build_engine_state(raw: RawEngineState) -> EngineState:
    """Classify each block and read its owners from the block tables (O(num_blocks))."""
    pool = raw.blocks
    # Lists only for blocks in use; free ones share one empty tuple (a list each would be
    # thousands of allocations per poll).
    held_by: defaultdict[int, list[str]] = defaultdict(list)
    for sequence_id, block_ids in pool.tables.items():
        for block_id in block_ids:
            held_by[block_id].append(sequence_id)
    owners: list[Sequence[str]] = [_NO_OWNERS] * pool.num_blocks
    for block_id, sequence_ids in held_by.items():
        owners[block_id] = sequence_ids
    states = [
        "in_use" if ref_count else "cached" if is_hashed else "free"
        for ref_count, is_hashed in zip(pool.ref_counts, pool.is_hashed, strict=True)
    ]
    return EngineState(
        time=raw.time,
        num_steps=raw.num_steps,
        block_size=pool.block_size,
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        enable_prefix_caching=pool.enable_prefix_caching,
        block_states=states,
        ref_counts=pool.ref_counts,
        owner_ids=owners,
        is_hashed=pool.is_hashed,
        running=raw.scheduler.running,
        waiting=raw.scheduler.waiting,
        last_plan=raw.last_plan,
        stats=raw.stats,
    )
