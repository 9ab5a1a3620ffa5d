"""Scheduler unit tests for prompt logprobs: which rows each chunk scores (every prompt token
once, across chunks and preemption), no prefix-cache hit over rows still to send (while the
request's blocks fill the cache for others), and max_tokens 0 ending a request right after its
prefill with no token. Driven by the fake model runner of tests/conftest.py."""

from pagedserve.scheduler import RequestStatus
from tests.conftest import (
    FakeModelRunner,
    RunLog,
    check_all_free,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def scoring_request(request_id, num_prompt_tokens, **sampling):
    request = make_request(request_id, num_prompt_tokens, prompt_logprobs=1, **sampling)
    request.needs_prompt_logprobs = True
    return request


def scored_tokens(plans, request_id):
    """Prompt positions whose logprob the plans score for `request_id`, in order."""
    return [
        s.start_position + row + 1
        for plan in plans
        for s in plan.requests
        if s.sequence_id == request_id
        for row in s.prompt_logprob_rows
    ]


def test_chunks_score_every_prompt_token_but_the_first_exactly_once():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    request = scoring_request("a", 10, max_tokens=2)
    scheduler.add_request(request)
    log = run_to_completion(scheduler)
    rows = [list(s.prompt_logprob_rows) for plan in log.plans for s in plan.requests]
    # chunks [0,4) [4,8) [8,10): rows score tokens 1-4, 5-8, 9; the last row samples; decode none
    assert rows == [[0, 1, 2, 3], [0, 1, 2, 3], [0], []]
    assert scored_tokens(log.plans, "a") == list(range(1, 10))
    assert request.num_prompt_logprob_tokens == 10


def test_a_scoring_request_takes_no_cached_prefix_but_fills_the_cache_for_others():
    scheduler = make_scheduler(num_blocks=12, block_size=4)
    runner, log = FakeModelRunner(scheduler), RunLog()
    first = make_request("a", 9, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)  # blocks 0 and 1 cached
    scorer = scoring_request("b", 0, prompt_token_ids=first.prompt_token_ids, max_tokens=1)
    scheduler.add_request(scorer)
    plan = step(scheduler, runner, log)
    assert plan.requests[0].start_position == 0 and plan.requests[0].num_new_tokens == 9
    assert scorer.num_cached_tokens == 0 and scheduler.prefix_cache_hits == 0
    assert scheduler.block_manager.block_ids("b")[:2] != [0, 1]
    plain = make_request("c", prompt_token_ids=first.prompt_token_ids, max_tokens=1)
    scheduler.add_request(plain)
    plan = step(scheduler, runner, log)
    assert plan.requests[0].start_position == 8 and plain.num_cached_tokens == 8
    run_to_completion(scheduler, runner)


def test_preempted_mid_prompt_resumes_from_the_cache_exactly_where_its_rows_stop():
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=4)
    request = scoring_request("a", 14, max_tokens=2)
    scheduler.add_request(request)
    runner, log = FakeModelRunner(scheduler), RunLog()
    step(scheduler, runner, log)
    step(scheduler, runner, log)  # positions 0-7 computed: tokens 0-8 have their logprobs
    assert request.num_prompt_logprob_tokens == 9
    scheduler._preempt(request)
    plan = step(scheduler, runner, log)
    # Row 8 scores token 9: the cache may cover positions 0-7, which are two full blocks.
    (resumed,) = plan.requests
    assert resumed.start_position == 8 and list(resumed.prompt_logprob_rows) == [0, 1, 2, 3]
    run_to_completion(scheduler, runner)
    assert scored_tokens(log.plans, "a") == list(range(1, 13)) and request.num_preemptions == 1


def test_max_tokens_zero_ends_the_request_after_its_prefill_with_no_token():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    request = scoring_request("a", 6, max_tokens=0)
    scheduler.add_request(request)
    runner = FakeModelRunner(scheduler)
    step(scheduler, runner)
    plan = scheduler.schedule()
    assert [s.needs_sample for s in plan.requests] == [False]
    updates = scheduler.update_from_output(plan, runner.execute(plan))
    assert [(u.sequence_id, u.new_token_ids, u.status) for u in updates] == [
        ("a", [], RequestStatus.FINISHED_LENGTH)
    ]
    assert request.output_token_ids == [] and not scheduler.has_unfinished_requests()
    check_all_free(scheduler)
