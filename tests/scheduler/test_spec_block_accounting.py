"""Block accounting under speculation: drafts reserve slots, only accepted tokens count as computed.

A fake model runs each plan over a simulated paged KV cache (as tests/conftest.py's runner): it
writes every scheduled position, drafts included, with the digest of the prefix it was computed
for, and reads each request's history back through its table. It then accepts all, none or some
of the drafts, by the test's choice. After every step the test checks that no rejected position
is counted as computed, registered in the prefix cache or read as history, and that the pool's
reference counts match the tables; at the end that every block is free.
"""

from __future__ import annotations

import pytest

from pagedserve.cache import BlockManager
from pagedserve.cache.block_manager import hash_block
from pagedserve.cache.block_table import ceil_div
from pagedserve.configs import SchedulerConfig, SpeculativeConfig
from pagedserve.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from tests.conftest import check_all_free, check_state, make_request, prefix_digests

PATTERN = [5, 6, 7, 8]  # prompts repeat it, so the n-gram proposer always finds a match
K = 5  # drafts per step: more than a block of 4, so runs cross block boundaries


def make_spec_scheduler(num_blocks: int = 64, block_size: int = 4, **spec: object) -> Scheduler:
    spec_config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=K,
        prompt_lookup_min=1,
        prompt_lookup_max=3,
        min_acceptance_rate=0.0,
        **spec,
    )
    config = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=8, speculative_config=spec_config
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, True), max_model_len=256)


class SpeculativeFakeRunner:
    """Stores every scheduled position's 'K/V', checks histories, accepts drafts as told."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.size = scheduler.block_manager.block_size
        self.kv: dict[int, tuple[int, int]] = {}
        self.num_rejected_positions = 0

    def execute(self, plan: SchedulerOutput, mode: str) -> tuple[ModelRunnerOutput, dict]:
        size = self.size
        for src, dst in plan.block_copies:
            for offset in range(size):
                entry = self.kv.get(src * size + offset)
                if entry is None:
                    self.kv.pop(dst * size + offset, None)
                else:
                    self.kv[dst * size + offset] = entry
        for scheduled in plan.requests:
            request = self.scheduler.requests[scheduled.sequence_id]
            context = request.all_token_ids[: scheduled.start_position] + scheduled.token_ids
            digests = prefix_digests(context)
            for index, slot in enumerate(scheduled.slot_mapping):
                position = scheduled.start_position + index
                self.kv[slot] = (position, digests[position])
        sampled, accepted = {}, {}
        for scheduled in plan.requests:
            request = self.scheduler.requests[scheduled.sequence_id]
            expected = prefix_digests(request.all_token_ids[: scheduled.start_position])
            for position, digest in enumerate(expected):  # history: only accepted K/V
                block_id = scheduled.block_ids[position // size]
                assert self.kv[block_id * size + position % size] == (position, digest)
            if not scheduled.needs_sample:
                continue
            drafts = list(scheduled.draft_token_ids)
            num_accepted = {"all": len(drafts), "none": 0, "partial": len(drafts) // 2}[mode]
            accepted[scheduled.sequence_id] = drafts[:num_accepted]
            self.num_rejected_positions += len(drafts) - num_accepted
            # on rejection, a pattern token other than the draft (keeps the proposer matching)
            rejected = drafts[num_accepted] if num_accepted < len(drafts) else None
            sampled[scheduled.sequence_id] = next(t for t in PATTERN if t != rejected)
        return ModelRunnerOutput(sampled, accepted), accepted


def check_accounting(scheduler: Scheduler, plan: SchedulerOutput, accepted: dict) -> None:
    """No rejected position is computed or cached; tables hold no more than drafting needs."""
    block_manager, size = scheduler.block_manager, scheduler.block_manager.block_size
    check_state(scheduler)
    for scheduled in plan.requests:
        request = scheduler.requests.get(scheduled.sequence_id)
        if request is None or not scheduled.needs_sample:
            continue
        num_real = scheduled.num_new_tokens - len(scheduled.draft_token_ids)
        num_accepted = len(accepted[scheduled.sequence_id])
        assert request.num_computed_tokens == scheduled.start_position + num_real + num_accepted
        assert request.num_computed_tokens == request.num_tokens - 1
        table = block_manager.get_table(request.sequence_id)
        assert len(table) <= ceil_div(request.num_tokens, size), "rejected-only blocks returned"
        parent = 0
        for index, block_id in enumerate(table.block_ids):
            block = block_manager.pool.blocks[block_id]
            if index >= request.num_computed_tokens // size:
                assert block.block_hash is None, "a block with rejected positions is cached"
                continue
            chunk = request.all_token_ids[index * size : (index + 1) * size]
            parent = hash_block(parent, chunk)
            assert block.block_hash in (None, parent), "cached under tokens it does not hold"


def run(scheduler: Scheduler, modes: list[str], max_steps: int = 400) -> SpeculativeFakeRunner:
    runner = SpeculativeFakeRunner(scheduler)
    for step_index in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        output, accepted = runner.execute(plan, modes[step_index % len(modes)])
        scheduler.update_from_output(plan, output)
        check_accounting(scheduler, plan, accepted)
    else:
        raise AssertionError("no completion")
    check_all_free(scheduler)
    return runner


@pytest.mark.parametrize(
    "modes", [["all"], ["none"], ["partial"], ["all", "none", "partial"], ["none", "all"]]
)
def test_accepted_rejected_and_partial_drafts_keep_the_cache_exact(modes):
    scheduler = make_spec_scheduler()
    for index in range(3):
        scheduler.add_request(
            make_request(f"r{index}", prompt_token_ids=PATTERN * (3 + index), max_tokens=40)
        )
    runner = run(scheduler, modes)
    assert scheduler.speculator.num_draft_tokens > 0
    assert scheduler.speculator.num_accepted_tokens == (
        scheduler.speculator.num_draft_tokens - runner.num_rejected_positions
    )
    if modes != ["all"]:
        assert runner.num_rejected_positions > 0


def test_accepted_runs_stop_exactly_at_max_tokens():
    scheduler = make_spec_scheduler()
    request = make_request("r", prompt_token_ids=PATTERN * 3, max_tokens=13)
    scheduler.add_request(request)
    run(scheduler, ["all"])
    assert request.num_output_tokens == 13 and request.status.finish_reason == "length"


def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    scheduler = make_spec_scheduler()
    request = make_request("r", prompt_token_ids=PATTERN * 3, max_tokens=40, stop_token_ids=(7,))
    scheduler.add_request(request)
    run(scheduler, ["all"])
    assert request.output_token_ids[-1] == 7 and 7 not in request.output_token_ids[:-1]
    assert request.status.finish_reason == "stop"


def test_speculation_under_preemption_leaks_nothing():
    # 12 blocks of 4: three growing requests cannot all fit, so some are preempted and recomputed
    scheduler = make_spec_scheduler(num_blocks=12)
    for index in range(3):
        scheduler.add_request(
            make_request(f"r{index}", prompt_token_ids=PATTERN * 2, max_tokens=30)
        )
    run(scheduler, ["partial", "all", "none"])
    assert scheduler.num_preemptions > 0


def test_drafts_never_preempt_another_request():
    # Exactly enough blocks for both requests without drafts: drafts must be cut, not preempt
    scheduler = make_spec_scheduler(num_blocks=8)
    for index in range(2):
        scheduler.add_request(make_request(f"r{index}", prompt_token_ids=PATTERN * 3, max_tokens=4))
    run(scheduler, ["all"])
    assert scheduler.num_preemptions == 0


def test_no_drafts_above_the_batch_size_gate():
    scheduler = make_spec_scheduler(disable_by_batch_size=2)
    for index in range(3):
        max_tokens = 30 if index == 0 else 3
        scheduler.add_request(
            make_request(f"r{index}", prompt_token_ids=PATTERN * 2, max_tokens=max_tokens)
        )
    runner = SpeculativeFakeRunner(scheduler)
    num_drafting_steps = 0
    while scheduler.has_unfinished_requests():
        num_running = scheduler.num_running
        plan = scheduler.schedule()
        if num_running > 2 or scheduler.num_running > 2:
            assert not any(s.draft_token_ids for s in plan.requests)
        num_drafting_steps += any(s.draft_token_ids for s in plan.requests)
        scheduler.update_from_output(plan, runner.execute(plan, "all")[0])
    check_all_free(scheduler)
    assert num_drafting_steps > 0  # once the two short ones have finished, the long one drafts
