"""Plain copies of the scheduler's queues and of a plan, for the engine-state endpoint.

Taken on the engine thread between steps (`snapshot_scheduler`, `snapshot_plan`); nothing here
refers back to a live `Request`, so a snapshot may be read on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """One sequence's progress. `block_table` is its logical -> physical block list."""

    sequence_id: str  # "<request_id>#<index>": one choice of one request
    status: str  # "running", "waiting" or "preempted" (waiting again, to recompute)
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache when first scheduled
    num_preemptions: int
    priority: int
    parent_sequence_id: str | None  # set while an n > 1 choice waits to fork its parent's prompt
    block_table: list[int]


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One sequence's share of the last step: `num_new_tokens` from `start_position` on."""

    sequence_id: str
    num_new_tokens: int
    start_position: int
    needs_sample: bool  # False for a prompt chunk that is not the prompt's last


@dataclass(frozen=True, slots=True)
class PlanSnapshot:
    requests: list[PlannedRequest]
    num_batched_tokens: int
    token_budget: int  # max_num_batched_tokens
    num_block_copies: int  # copy-on-write copies run before that step's forward pass


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    running: list[RequestSnapshot]  # in serve order: the tail is preempted first
    waiting: list[RequestSnapshot]  # in serve order, then choices waiting for their parent
    num_preemptions: int


def snapshot_scheduler(scheduler: Scheduler) -> SchedulerSnapshot:
    """Copy the queues, each sequence with its block table. Mutates nothing."""
    table_of = scheduler.block_manager.block_ids
    return SchedulerSnapshot(
        running=[snapshot_request(r, table_of(r.sequence_id)) for r in scheduler.running],
        waiting=[
            snapshot_request(r, table_of(r.sequence_id))
            for queue in (scheduler.waiting, scheduler.fork_waiting)
            for r in queue
        ],
        num_preemptions=scheduler.num_preemptions,
    )


def snapshot_request(request: Request, block_table: list[int]) -> RequestSnapshot:
    return RequestSnapshot(
        sequence_id=request.sequence_id,
        status=request.status.name.lower(),
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        priority=request.priority,
        parent_sequence_id=request.parent_sequence_id,
        block_table=list(block_table),
    )


def snapshot_plan(plan: SchedulerOutput, token_budget: int) -> PlanSnapshot:
    return PlanSnapshot(
        requests=[
            PlannedRequest(s.sequence_id, s.num_new_tokens, s.start_position, s.needs_sample)
            for s in plan.requests
        ],
        num_batched_tokens=plan.num_batched_tokens,
        token_budget=token_budget,
        num_block_copies=len(plan.block_copies),
    )
