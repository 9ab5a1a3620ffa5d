"""Shared test factories: requests, schedulers, and a fake model runner with a checked step loop.

The fake runner keeps a simulated paged KV cache: it runs the plan's block copies, writes every
scheduled token's "K/V" (a digest of its whole prefix) into its slot and samples from what it reads
back through the block table, so a wrong slot, a missed copy-on-write or a prefix-cache block of
another prefix is caught (and would change the output) instead of passing silently.
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from pagedserve.cache import BlockManager
from pagedserve.cache.block_table import ceil_div
from pagedserve.configs import SamplingParams, SchedulerConfig
from pagedserve.scheduler import (
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)

# Helpers that assert, shared by several test files: rewritten like test files, so their failures
# show the compared values. The root conftest loads before any test module imports them.
pytest.register_assert_rewrite(
    "tests.cache.support", "tests.scheduler.support", "tests.reliability.support"
)

# Without CUDA the Triton kernels run under Triton's interpreter, which must be switched on before
# anything imports triton (transformers and torch may, during collection of other packages' tests):
# triton.language's own helpers are decorated at import time. The root conftest loads first.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _unfreeze_after_test():
    """`LLM` freezes the objects alive after its start-up out of the garbage collector's full
    passes (engine/heap.py); the suite builds and drops many, so each test hands its frozen
    objects back to the collector."""
    yield
    gc.unfreeze()


EOS_TOKEN_ID = 2  # fake_next_token never yields 0..2, so EOS only comes when a test forces it
_arrival_clock = itertools.count(1)


def _mix(state: int, value: int) -> int:
    return (state * 1_000_003 + value + 1) % (1 << 61)


def prefix_digests(token_ids: Sequence[int]) -> list[int]:
    """What a real model's K/V at each position depends on: the whole prefix up to it."""
    digests, state = [], 17
    for token_id in token_ids:
        state = _mix(state, token_id)
        digests.append(state)
    return digests


def _sample(digest: int, seed: int) -> int:
    return _mix(digest, seed) % 997 + 3


def fake_next_token(token_ids: Sequence[int], seed: int | None = None) -> int:
    """A deterministic 'model': the next token hashes the whole history (3..999) and the seed."""
    return _sample(prefix_digests(token_ids)[-1], seed or 0)


def expected_output_token_ids(request: Request) -> list[int]:
    """What an unconstrained run generates for `request` if nothing stops it before max_tokens."""
    state, seed, output = (
        prefix_digests(request.prompt_token_ids)[-1],
        request.sampling_params.seed,
        [],
    )
    for _ in range(request.sampling_params.max_tokens):
        output.append(_sample(state, seed or 0))
        state = _mix(state, output[-1])
    return output


def make_prompt(seed: str | int, num_tokens: int) -> list[int]:
    rng = random.Random(zlib.crc32(str(seed).encode()))
    return [rng.randint(3, 999) for _ in range(num_tokens)]


def make_request(
    sequence_id: str,
    num_prompt_tokens: int = 8,
    *,
    prompt_token_ids: list[int] | None = None,
    max_tokens: int = 8,
    ignore_eos: bool = False,
    arrival_time: float | None = None,
    priority: int = 0,
    parent_sequence_id: str | None = None,
    **sampling: object,
) -> Request:
    """A sequence with a prompt derived from its id (distinct ids share no prefix by accident)."""
    if prompt_token_ids is None:
        prompt_token_ids = make_prompt(sequence_id, num_prompt_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling)
    return Request(
        sequence_id,
        list(prompt_token_ids),
        params,
        eos_token_id=EOS_TOKEN_ID,
        arrival_time=next(_arrival_clock) if arrival_time is None else arrival_time,
        priority=priority,
        parent_sequence_id=parent_sequence_id,
    )


def make_scheduler(
    num_blocks: int = 8,
    block_size: int = 4,
    *,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    scheduling_policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        scheduling_policy=scheduling_policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(config, block_manager, max_model_len=max_model_len)


class FakeModelRunner:
    """Plays the model over a simulated paged KV cache (see the module docstring).

    A slot holds (position, digest of the prefix up to it), like real K/V, which depend on the
    whole prefix: a block cached under the wrong prefix, or overwritten, is caught on read.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_manager.block_size
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, prefix digest)

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def read_digests(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """The cached digests of positions [0, num_tokens), read through the block table."""
        digests = []
        for pos in range(num_tokens):
            stored_pos, digest = self.kv.get(self._slot(block_ids, pos), (-1, -1))
            assert stored_pos == pos, f"position {pos} reads a slot holding position {stored_pos}"
            digests.append(digest)
        return digests

    def execute(
        self, plan: SchedulerOutput, forced: dict[str, int] | None = None
    ) -> ModelRunnerOutput:
        size = self.block_size
        for src, dst in plan.block_copies:  # copy-on-write runs before the forward pass
            for offset in range(size):
                entry = self.kv.get(src * size + offset)
                if entry is None:
                    self.kv.pop(dst * size + offset, None)
                else:
                    self.kv[dst * size + offset] = entry
        # As the real runner: every scheduled token's K/V is stored first (a layer stores the whole
        # batch, then attends), then each request reads its whole history back through its table,
        # so a write that lands in another request's history in the same step is caught too.
        sampled = {}
        for scheduled in plan.requests:
            start, request = (
                scheduled.start_position,
                self.scheduler.requests[scheduled.sequence_id],
            )
            digests = prefix_digests(request.all_token_ids[: scheduled.seq_len])
            for index, slot in enumerate(scheduled.slot_mapping):
                self.kv[slot] = (start + index, digests[start + index])
        for scheduled in plan.requests:
            request = self.scheduler.requests[scheduled.sequence_id]
            history = self.read_digests(scheduled.block_ids, scheduled.seq_len)
            assert history == prefix_digests(request.all_token_ids[: scheduled.seq_len]), (
                f"{request.sequence_id} reads K/V of another prefix"
            )
            if scheduled.needs_sample:
                sampled[scheduled.sequence_id] = _sample(
                    history[-1], request.sampling_params.seed or 0
                )
        sampled.update(forced or {})
        return ModelRunnerOutput(sampled)


def _snapshot(scheduler: Scheduler) -> dict[str, tuple[int, list[int] | None]]:
    tables = scheduler.block_manager.tables
    return {
        request_id: (
            request.num_computed_tokens,
            list(tables[request_id].block_ids) if request_id in tables else None,
        )
        for request_id, request in scheduler.requests.items()
    }


def check_plan(
    scheduler: Scheduler, plan: SchedulerOutput, before: dict, preempted: list[str]
) -> None:
    """The plan is consistent: budgets, slots from the block table, exclusive writes, preemptions."""
    config, block_manager = scheduler.config, scheduler.block_manager
    size, blocks = block_manager.block_size, block_manager.pool.blocks
    assert plan.num_batched_tokens == sum(s.num_new_tokens for s in plan.requests)
    assert plan.num_batched_tokens <= config.max_num_batched_tokens
    assert (
        len(plan.requests) <= config.max_num_seqs and scheduler.num_running <= config.max_num_seqs
    )
    assert len({s.sequence_id for s in plan.requests}) == len(plan.requests)
    written: set[int] = set()
    for scheduled in plan.requests:
        request = scheduler.requests[scheduled.sequence_id]
        table = block_manager.get_table(request.sequence_id)
        start, end = scheduled.start_position, scheduled.seq_len
        assert request.status == RequestStatus.RUNNING and scheduled.num_new_tokens >= 1
        assert start == request.num_computed_tokens, "reserving is not computing"
        assert scheduled.token_ids == request.all_token_ids[start:end]
        assert scheduled.block_ids == table.block_ids and end <= table.num_slots
        assert scheduled.slot_mapping == [
            table.block_ids[pos // size] * size + pos % size for pos in range(start, end)
        ]
        assert scheduled.needs_sample == (
            end == request.num_tokens and request.sampling_params.max_tokens > 0
        )
        for block_id in {slot // size for slot in scheduled.slot_mapping}:
            assert blocks[block_id].ref_count == 1, (
                f"{request.sequence_id} writes shared block {block_id}"
            )
        assert written.isdisjoint(scheduled.slot_mapping), "two requests write one slot"
        written.update(scheduled.slot_mapping)
        if (
            before.get(request.sequence_id, (0, None))[1] is not None
            and request.parent_sequence_id is None
        ):
            assert len(table) == ceil_div(end, size), "a table grows by exactly what the step needs"
    scheduled_ids = {s.sequence_id for s in plan.requests}
    for request_id in preempted:
        request = scheduler.requests[request_id]
        assert request_id not in scheduled_ids and request in scheduler.waiting
        assert request.num_computed_tokens == 0 and request_id not in block_manager.tables
    for request_id, (num_computed, block_ids) in before.items():
        if request_id in scheduled_ids or request_id in preempted:
            continue
        request = scheduler.requests[request_id]
        if block_ids is None and request.parent_sequence_id is not None:
            continue  # forked this step: shares its parent's table, prompt less one token computed
        assert request.num_computed_tokens == num_computed, f"{request_id} advanced without running"
        assert block_manager.block_ids(request_id) == (block_ids or []), f"{request_id} table moved"


def check_state(scheduler: Scheduler) -> None:
    """Queues partition the live requests; every request's progress is covered by its table."""
    block_manager = scheduler.block_manager
    block_manager.check_invariants()
    queues = [*scheduler.waiting, *scheduler.running, *scheduler.fork_waiting]
    assert len(queues) == len(set(queues)) == len(scheduler.requests)
    assert {r.sequence_id for r in queues} == set(scheduler.requests)
    assert set(block_manager.tables) <= set(scheduler.requests)
    for request in scheduler.running:
        table = block_manager.get_table(request.sequence_id)
        assert request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens <= min(table.num_slots, request.num_tokens)
    for request in [*scheduler.waiting, *scheduler.fork_waiting]:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0 and request.sequence_id not in block_manager.tables


@dataclass(frozen=True)
class CheckedStep:
    """A plan, and the sequences its `schedule()` preempted (read from their preemption counts).

    Reads as the plan itself (`.requests`, `.num_batched_tokens`, ...)."""

    plan: SchedulerOutput
    preempted_sequence_ids: list[str]

    def __getattr__(self, name: str) -> object:
        return getattr(self.plan, name)


@dataclass
class RunLog:
    """What a checked run did: every plan, and each finished request with its finishing step."""

    plans: list[CheckedStep] = field(default_factory=list)
    finished: dict[str, Request] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)


def step(
    scheduler: Scheduler,
    runner: FakeModelRunner,
    log: RunLog | None = None,
    forced: dict[str, int] | None = None,
) -> CheckedStep:
    """One checked engine step: schedule, check, execute, update, check."""
    log = log if log is not None else RunLog()
    before = _snapshot(scheduler)
    live = dict(scheduler.requests)
    num_preemptions = {request_id: r.num_preemptions for request_id, r in live.items()}
    plan = scheduler.schedule()
    preempted = [
        request_id
        for request_id, request in live.items()
        if request.num_preemptions > num_preemptions[request_id]
    ]
    check_plan(scheduler, plan, before, preempted)
    scheduler.update_from_output(plan, runner.execute(plan, forced))
    check_state(scheduler)
    checked = CheckedStep(plan, preempted)
    log.plans.append(checked)
    for request_id, request in live.items():
        if request_id not in scheduler.requests:
            assert request.is_finished and request_id not in scheduler.block_manager.tables
            log.finished[request_id] = request
            log.finish_step[request_id] = len(log.plans)
    return checked


def run_to_completion(
    scheduler: Scheduler, runner: FakeModelRunner | None = None, max_steps: int = 5000
) -> RunLog:
    """Step until no request is left, checking invariants every step; then check nothing leaked."""
    runner = runner or FakeModelRunner(scheduler)
    log = RunLog()
    while scheduler.has_unfinished_requests():
        assert len(log.plans) < max_steps, "no progress"
        checked = step(scheduler, runner, log)
        assert checked.requests or checked.preempted_sequence_ids, "a step did nothing"
    check_all_free(scheduler)
    return log


def check_all_free(scheduler: Scheduler) -> None:
    block_manager = scheduler.block_manager
    block_manager.check_invariants()
    assert not block_manager.tables
    assert block_manager.num_free_blocks == block_manager.pool.num_blocks
