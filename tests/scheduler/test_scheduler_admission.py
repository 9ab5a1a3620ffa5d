"""Scheduler unit tests for who runs and with what: admission checks, growth and per-step budgets,
chunked prefill, and preemption under block pressure with the FCFS and priority policies.

Driven by the fake model runner in tests/conftest.py; `step` and `run_to_completion` check the plan
and the bookkeeping after every step (budgets, slots, exclusive writes, K/V read back, no leaks).
"""

import pytest

from pagedserve.scheduler import AdmissionError, RequestStatus
from tests.conftest import (
    FakeModelRunner,
    RunLog,
    expected_output_token_ids,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from tests.scheduler.support import ref_counts

# ---- admission ----------------------------------------------------------------------------------


def test_check_admissible_rejects_a_prompt_that_leaves_no_room_for_output():
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(AdmissionError) as error:
        scheduler.check_admissible(16, 8)
    assert error.value.param == "prompt"


def test_check_admissible_rejects_a_request_needing_more_blocks_than_the_whole_pool():
    scheduler = make_scheduler(num_blocks=4, block_size=4)  # 16 slots in all
    with pytest.raises(AdmissionError) as error:
        scheduler.check_admissible(12, 8)
    assert error.value.param == "max_tokens"
    # 12 + 5 tokens need exactly 16 slots (the last sampled token is never written): all 4 blocks.
    scheduler.check_admissible(12, 5)
    scheduler.add_request(make_request("fits", 12, max_tokens=5, ignore_eos=True))
    assert run_to_completion(scheduler).finished["fits"].num_output_tokens == 5


def test_check_admissible_rejects_an_empty_prompt():
    with pytest.raises(AdmissionError) as error:
        make_scheduler().check_admissible(0, 8)
    assert error.value.param == "prompt"


def test_max_tokens_past_max_model_len_is_admitted_and_stops_at_the_context_limit():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    request = make_request("a", 10, max_tokens=100, ignore_eos=True)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert (
        request.num_tokens == 16
        and request.output_token_ids == expected_output_token_ids(request)[:6]
    )


# ---- growth, budgets, failed allocations -------------------------------------------------------


def test_first_step_reserves_exact_slots_for_the_whole_prompt_without_computing():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("a", 10)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    (scheduled,) = plan.requests
    assert scheduled.token_ids == request.prompt_token_ids and scheduled.start_position == 0
    assert scheduled.block_ids == [0, 1, 2] and scheduled.slot_mapping == list(range(10))
    assert scheduled.needs_sample and plan.num_batched_tokens == 10
    assert request.num_computed_tokens == 0  # reserving is not computing
    assert scheduler.block_manager.num_free_blocks == 5


def test_decode_grows_the_table_by_one_block_only_at_a_block_boundary():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("a", 7, max_tokens=4))
    assert step(scheduler, runner).requests[0].block_ids == [0, 1]
    (decode,) = step(scheduler, runner).requests  # position 7: last slot of block 1
    assert (decode.block_ids, decode.slot_mapping) == ([0, 1], [7])
    (decode,) = step(scheduler, runner).requests  # position 8: needs a third block
    assert (decode.block_ids, decode.slot_mapping) == ([0, 1, 2], [8])


def test_token_budget_caps_each_step_and_the_overflow_becomes_a_chunk():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=10)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 6, max_tokens=3))
    runner, log = FakeModelRunner(scheduler), RunLog()
    plan = step(scheduler, runner, log)
    assert [(s.sequence_id, s.num_new_tokens, s.needs_sample) for s in plan.requests] == [
        ("a", 6, True),
        ("b", 4, False),
    ]
    assert scheduler.num_waiting == 1
    log = run_to_completion(scheduler, runner)
    assert all(plan.num_batched_tokens <= 10 for plan in log.plans)


def test_max_num_seqs_caps_the_running_requests():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    for index in range(4):
        scheduler.add_request(make_request(f"r{index}", 5, max_tokens=3))
    plan = scheduler.schedule()
    assert [s.sequence_id for s in plan.requests] == ["r0", "r1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2
    runner = FakeModelRunner(scheduler)
    scheduler.update_from_output(plan, runner.execute(plan))
    log = run_to_completion(scheduler, runner)
    assert max(len(plan.requests) for plan in log.plans) <= 2 and len(log.finished) == 4


def test_failed_admission_changes_no_table_count_or_reference():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeModelRunner(scheduler)
    first = make_request("a", 11, max_tokens=1, ignore_eos=True)
    scheduler.add_request(first)
    step(scheduler, runner)
    holder = make_request("holder", 11, max_tokens=5, ignore_eos=True)  # 3 blocks, decodes in place
    scheduler.add_request(holder)
    step(scheduler, runner)
    # Shares a's first (cached, free) block, then needs 2 more blocks with only 1 free.
    late = make_request("late", prompt_token_ids=first.prompt_token_ids[:4] + [5] * 5, max_tokens=2)
    scheduler.add_request(late)
    free_before, refs_before = scheduler.block_manager.num_free_blocks, ref_counts(scheduler)
    plan = step(scheduler, runner)
    assert [s.sequence_id for s in plan.requests] == ["holder"] and not plan.preempted_sequence_ids
    assert late.num_computed_tokens == 0 and "late" not in scheduler.block_manager.tables
    assert list(scheduler.waiting) == [late] and late.status == RequestStatus.WAITING
    assert (
        scheduler.block_manager.num_free_blocks == free_before
        and ref_counts(scheduler) == refs_before
    )
    log = run_to_completion(scheduler, runner)
    assert log.finished["late"].output_token_ids == expected_output_token_ids(late)


# ---- chunked prefill ---------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_while_other_requests_keep_decoding():
    budget = 8
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=budget)
    runner, log = FakeModelRunner(scheduler), RunLog()
    for request_id in ("d1", "d2"):
        scheduler.add_request(make_request(request_id, 4, max_tokens=40, ignore_eos=True))
    step(scheduler, runner, log)
    long_prompt = make_request("long", 8 * budget + 6, max_tokens=2, ignore_eos=True)
    scheduler.add_request(long_prompt)
    chunks = []
    while long_prompt.num_computed_tokens < long_prompt.num_prompt_tokens:
        plan = step(scheduler, runner, log)
        by_id = {s.sequence_id: s for s in plan.requests}
        assert [(by_id[d].num_new_tokens, by_id[d].needs_sample) for d in ("d1", "d2")] == [
            (1, True)
        ] * 2
        chunks.append(by_id["long"])
    assert len(chunks) == 12  # 70 prompt tokens, 6 per step beside the two decodes
    assert [c.start_position for c in chunks] == list(range(0, 70, 6))
    assert [c.needs_sample for c in chunks] == [False] * 11 + [True]
    assert all(c.num_new_tokens == 6 for c in chunks[:-1]) and chunks[-1].num_new_tokens == 4
    log = run_to_completion(scheduler, runner)
    assert log.finished["long"].output_token_ids == expected_output_token_ids(long_prompt)


def test_long_prefill_token_threshold_lets_prompts_prefill_side_by_side():
    # vLLM's --long-prefill-token-threshold: a 100-token prompt takes at most 16 tokens a step
    # while others share it, so a short prompt arriving behind it is done in its first step.
    scheduler = make_scheduler(
        num_blocks=64, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    runner, log = FakeModelRunner(scheduler), RunLog()
    long_prompt = make_request("long", 100, max_tokens=2, ignore_eos=True)
    scheduler.add_request(long_prompt)
    first = step(scheduler, runner, log)
    assert [(s.sequence_id, s.num_new_tokens) for s in first.requests] == [("long", 64)]  # alone
    for request_id in ("short", "mid"):
        scheduler.add_request(make_request(request_id, 10 if request_id == "short" else 40))
    second = step(scheduler, runner, log)
    assert [(s.sequence_id, s.num_new_tokens) for s in second.requests] == [
        ("long", 16),
        ("short", 10),
        ("mid", 16),
    ]
    assert [s.needs_sample for s in second.requests] == [False, True, False]
    log = run_to_completion(scheduler, runner)
    assert log.finished["long"].output_token_ids == expected_output_token_ids(long_prompt)


def test_without_a_threshold_a_long_prompt_takes_the_whole_budget():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    runner = FakeModelRunner(scheduler)
    for request_id, length in (("long", 100), ("short", 10)):
        scheduler.add_request(make_request(request_id, length, max_tokens=2, ignore_eos=True))
    plan = step(scheduler, runner)
    assert [(s.sequence_id, s.num_new_tokens) for s in plan.requests] == [("long", 64)]
    run_to_completion(scheduler, runner)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_takes_it_whole():
    # vLLM's --no-enable-chunked-prefill: 8 running decodes leave 56 of the 64-token budget, so
    # a 60-token prompt waits (and the short one behind it, in FCFS order) until they finish,
    # then runs whole. Nothing is reserved for it while it waits.
    scheduler = make_scheduler(
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=False,
    )
    runner, log = FakeModelRunner(scheduler), RunLog()
    for index in range(8):
        scheduler.add_request(make_request(f"d{index}", 4, max_tokens=3, ignore_eos=True))
    step(scheduler, runner, log)
    scheduler.add_request(make_request("long", 60, max_tokens=2, ignore_eos=True))
    scheduler.add_request(make_request("short", 4, max_tokens=2, ignore_eos=True))
    for _ in range(2):  # the decodes' last two tokens
        plan = step(scheduler, runner, log)
        assert {s.sequence_id for s in plan.requests} == {f"d{index}" for index in range(8)}
        assert "long" not in scheduler.block_manager.tables
    plan = step(scheduler, runner, log)
    assert [(s.sequence_id, s.num_new_tokens) for s in plan.requests] == [
        ("long", 60),
        ("short", 4),
    ]
    log = run_to_completion(scheduler, runner)
    assert set(log.finished) == {"long", "short"}


def test_with_chunked_prefill_the_same_prompt_starts_beside_the_decodes():
    scheduler = make_scheduler(
        num_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=64
    )
    runner = FakeModelRunner(scheduler)
    for index in range(8):
        scheduler.add_request(make_request(f"d{index}", 4, max_tokens=3, ignore_eos=True))
    step(scheduler, runner)
    scheduler.add_request(make_request("long", 60, max_tokens=2, ignore_eos=True))
    plan = step(scheduler, runner)
    assert [(s.sequence_id, s.num_new_tokens) for s in plan.requests][-1] == ("long", 56)
    run_to_completion(scheduler, runner)


def test_a_prompt_sorted_ahead_of_running_decodes_leaves_each_of_them_a_token():
    # A more important prompt arrives while four requests decode: it sorts ahead of them in
    # `running` (so would a recomputing preempted request under FCFS), and its chunks must not
    # take the whole budget.
    budget = 16
    scheduler = make_scheduler(
        num_blocks=64,
        block_size=4,
        scheduling_policy="priority",
        max_num_batched_tokens=budget,
        max_model_len=256,
    )
    runner = FakeModelRunner(scheduler)
    decodes = [
        make_request(f"d{i}", 4, max_tokens=40, priority=5, ignore_eos=True) for i in range(4)
    ]
    for request in decodes:
        scheduler.add_request(request)
    for _ in range(2):
        step(scheduler, runner)
    important = make_request("important", 120, max_tokens=2, priority=0, ignore_eos=True)
    scheduler.add_request(important)
    chunks = []
    while important.num_computed_tokens < important.num_prompt_tokens:
        by_id = {s.sequence_id: s.num_new_tokens for s in step(scheduler, runner).requests}
        assert [by_id.get(d.sequence_id) for d in decodes] == [1] * 4, by_id
        chunks.append(by_id["important"])
    assert chunks == [12] * 10  # 120 prompt tokens, 16 - 4 per step
    run_to_completion(scheduler, runner)


# ---- preemption --------------------------------------------------------------------------------


def test_scheduler_preempts_the_latest_arrived_request_when_out_of_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeModelRunner(scheduler)
    first, second = (make_request(r, 8, max_tokens=8, ignore_eos=True) for r in ("a", "b"))
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler, runner)  # both prefilled: all 4 blocks in use
    victim_blocks = list(scheduler.block_manager.block_ids("b"))
    plan = step(scheduler, runner)  # both need a 3rd block for position 8
    assert plan.preempted_sequence_ids == ["b"] and [s.sequence_id for s in plan.requests] == ["a"]
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert "b" not in scheduler.block_manager.tables and scheduler.waiting[0] is second
    assert len(second.output_token_ids) == 1  # generated tokens are kept
    assert scheduler.num_preemptions == 1 and second.num_preemptions == 1
    assert plan.requests[0].block_ids[2] in victim_blocks
    log = run_to_completion(scheduler, runner)
    assert all(
        log.finished[r.sequence_id].output_token_ids == expected_output_token_ids(r)
        for r in (first, second)
    )


def test_under_fcfs_a_preempted_request_waits_ahead_of_later_arrivals():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    runner = FakeModelRunner(scheduler)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 8, max_tokens=8, ignore_eos=True))
    step(scheduler, runner)
    assert step(scheduler, runner).preempted_sequence_ids == ["b"]
    assert [request.sequence_id for request in scheduler.waiting] == ["b", "c"]


def test_a_readmitted_request_is_not_counted_again_in_the_prefix_cache_statistics():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeModelRunner(scheduler)
    for request_id in "ab":
        scheduler.add_request(make_request(request_id, 8, max_tokens=8, ignore_eos=True))
    run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions >= 1
    assert scheduler.prefix_cache_queries == 8 + 8  # each prompt once, not again on readmission


def test_priority_policy_preempts_the_lowest_priority_even_when_it_arrived_first():
    scheduler = make_scheduler(num_blocks=4, block_size=4, scheduling_policy="priority")
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("low", 8, max_tokens=8, priority=1))
    scheduler.add_request(make_request("high", 8, max_tokens=8, priority=0))
    assert [s.sequence_id for s in step(scheduler, runner).requests] == ["high", "low"]
    plan = step(scheduler, runner)
    assert plan.preempted_sequence_ids == ["low"] and [s.sequence_id for s in plan.requests] == [
        "high"
    ]
    assert scheduler.waiting[0].sequence_id == "low"
    run_to_completion(scheduler, runner)


def test_priority_policy_admits_waiting_requests_by_priority_then_arrival():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    for request_id, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0)]:
        scheduler.add_request(make_request(request_id, 4, max_tokens=1, priority=priority))
    log = run_to_completion(scheduler)
    assert [plan.requests[0].sequence_id for plan in log.plans] == ["b", "d", "c", "a"]


def test_failing_request_that_is_the_only_candidate_preempts_itself_and_waits():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeModelRunner(scheduler)
    older = make_request("a", 7, max_tokens=9, ignore_eos=True)  # position 7 fits in its block 1
    newer = make_request("b", 8, max_tokens=8, ignore_eos=True)  # position 8 needs a 3rd block
    scheduler.add_request(older)
    scheduler.add_request(newer)
    step(scheduler, runner)
    plan = step(scheduler, runner)
    assert [s.sequence_id for s in plan.requests] == ["a"] and plan.preempted_sequence_ids == ["b"]
    assert scheduler.waiting[0] is newer and newer.status == RequestStatus.PREEMPTED
    assert older.num_computed_tokens == 8 and scheduler.num_preemptions == 1
    log = run_to_completion(scheduler, runner)
    assert log.finished["b"].output_token_ids == expected_output_token_ids(newer)


def test_preempted_request_recomputes_its_prompt_and_generated_tokens_when_readmitted():
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    runner, log = FakeModelRunner(scheduler), RunLog()
    scheduler.add_request(make_request("a", 8, max_tokens=8, ignore_eos=True))
    victim = make_request("b", 8, max_tokens=8, ignore_eos=True)
    scheduler.add_request(victim)
    step(scheduler, runner, log)
    assert step(scheduler, runner, log).preempted_sequence_ids == ["b"]
    tokens_at_preemption = list(victim.all_token_ids)
    for _ in range(50):
        if any(s.sequence_id == "b" for s in step(scheduler, runner, log).requests):
            break
    else:
        pytest.fail("the preempted request was never readmitted")
    resumed = next(s for s in log.plans[-1].requests if s.sequence_id == "b")
    assert resumed.start_position == 0 and resumed.token_ids == tokens_at_preemption
    log = run_to_completion(scheduler, runner)
    assert log.finished["b"].output_token_ids == expected_output_token_ids(victim)


def test_priority_policy_admits_a_waiting_higher_priority_request_before_a_preempted_lower_one():
    scheduler = make_scheduler(num_blocks=6, block_size=4, scheduling_policy="priority")
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("low", 8, priority=5, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("high1", 8, priority=0, max_tokens=12, ignore_eos=True))
    step(scheduler, runner)
    scheduler.add_request(make_request("high2", 8, priority=0, max_tokens=8, ignore_eos=True))
    for _ in range(50):  # high1 grows and preempts low
        if step(scheduler, runner).preempted_sequence_ids:
            break
    else:
        pytest.fail("no preemption happened")
    # 2 blocks are free now: enough for high2's prompt, not for low's 13 tokens. Yet low sits at
    # the head of `waiting` and blocks high2 until high1 finishes.
    plan = step(scheduler, runner)
    assert "high2" in [s.sequence_id for s in plan.requests]
