"""Scheduler unit tests for how requests end: EOS, stop token ids, max_tokens and min_tokens, aborts
(waiting, running, between schedule and update, fork-waiting children) and finishing with an error,
each freeing the request's blocks at once.

Driven by the fake model runner in tests/conftest.py; `step` and `run_to_completion` check the plan
and the bookkeeping after every step (budgets, slots, exclusive writes, K/V read back, no leaks).
"""

import pytest

from pagedserve.scheduler import ModelRunnerOutput, RequestStatus
from tests.conftest import (
    EOS_TOKEN_ID,
    FakeModelRunner,
    check_all_free,
    check_state,
    expected_output_token_ids,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

# ---- stops -------------------------------------------------------------------------------------


def start_one(max_tokens=10, **sampling):
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("a", 6, max_tokens=max_tokens, **sampling)
    scheduler.add_request(request)
    runner = FakeModelRunner(scheduler)
    step(scheduler, runner)
    return scheduler, runner, request


def test_eos_finishes_the_request_and_frees_its_blocks_at_once():
    scheduler, runner, request = start_one()
    step(scheduler, runner, forced={"a": EOS_TOKEN_ID})
    assert (
        request.status == RequestStatus.FINISHED_STOPPED and request.status.finish_reason == "stop"
    )
    assert request.output_token_ids[-1] == EOS_TOKEN_ID and not scheduler.has_unfinished_requests()
    check_all_free(scheduler)


def test_eos_is_ignored_with_ignore_eos():
    scheduler, runner, request = start_one(max_tokens=4, ignore_eos=True)
    step(scheduler, runner, forced={"a": EOS_TOKEN_ID})
    assert request.status == RequestStatus.RUNNING
    run_to_completion(scheduler, runner)
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 4


def test_stop_token_ids_finish_the_request_even_with_ignore_eos():
    scheduler, runner, request = start_one(ignore_eos=True, stop_token_ids=(7,))
    step(scheduler, runner, forced={"a": 7})
    assert request.status == RequestStatus.FINISHED_STOPPED and request.num_output_tokens == 2
    check_all_free(scheduler)


def test_max_tokens_finishes_the_request_with_length():
    scheduler = make_scheduler()
    request = make_request("a", 5, max_tokens=3)
    scheduler.add_request(request)
    log = run_to_completion(scheduler)
    assert (
        request.status == RequestStatus.FINISHED_LENGTH and request.status.finish_reason == "length"
    )
    assert log.finish_step["a"] == 3 and request.output_token_ids == expected_output_token_ids(
        request
    )


def test_min_tokens_delays_eos_and_stop_token_ids():
    scheduler, runner, request = start_one(min_tokens=4, stop_token_ids=(7,))
    for token_id in (EOS_TOKEN_ID, 7, EOS_TOKEN_ID):  # outputs 2..4 (the first came from prefill)
        assert request.status == RequestStatus.RUNNING
        step(scheduler, runner, forced={"a": token_id})
    assert request.status == RequestStatus.FINISHED_STOPPED and request.num_output_tokens == 4
    check_all_free(scheduler)


# ---- abort and finish --------------------------------------------------------------------------


def test_abort_of_a_waiting_request_removes_it_from_every_queue():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    aborted = scheduler.abort_request("a")
    assert (
        aborted.status == RequestStatus.FINISHED_ABORTED and aborted.status.finish_reason == "abort"
    )
    assert not scheduler.has_unfinished_requests() and scheduler.num_waiting == 0
    assert scheduler.abort_request("a") is None and scheduler.abort_request("unknown") is None
    check_all_free(scheduler)


@pytest.mark.parametrize("num_steps", [1, 3], ids=["mid_prefill", "decoding"])
def test_abort_of_a_running_request_frees_all_its_blocks_at_once(num_steps):
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=8))
    scheduler.add_request(make_request("b", 3, max_tokens=8))
    for _ in range(num_steps):
        step(scheduler, runner)
    assert scheduler.block_manager.block_ids("a")
    scheduler.abort_request("a")
    check_state(scheduler)
    assert scheduler.block_manager.num_free_blocks == 16 - len(
        scheduler.block_manager.block_ids("b")
    )
    scheduler.abort_request("b")
    check_all_free(scheduler)


def test_abort_between_schedule_and_update_frees_at_once_and_the_update_skips_it():
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", 12, max_tokens=4))
    plan = scheduler.schedule()  # a non-final chunk: blocks reserved, nothing computed yet
    scheduler.abort_request("a")
    check_all_free(scheduler)
    assert scheduler.update_from_output(plan, ModelRunnerOutput({})) == []
    check_all_free(scheduler)


def test_finish_request_with_error_frees_blocks_and_reports_error():
    scheduler, runner, request = start_one()
    assert scheduler.finish_request("a", RequestStatus.FINISHED_ERROR) is request
    assert request.status.finish_reason == "error"
    check_all_free(scheduler)


def test_abort_of_a_fork_waiting_child_removes_it():
    scheduler = make_scheduler()
    parent = make_request("p", 6)
    scheduler.add_request(parent)
    scheduler.add_request(
        make_request("c", prompt_token_ids=parent.prompt_token_ids, parent_sequence_id="p")
    )
    assert scheduler.num_waiting == 2
    scheduler.abort_request("c")
    assert not scheduler.fork_waiting and scheduler.num_waiting == 1
    run_to_completion(scheduler)
