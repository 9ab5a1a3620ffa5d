"""Scheduler unit tests for KV block sharing: n > 1 through fork (the child waits for the parent's
prompt, then shares its blocks with copy-on-write, and never poisons the prefix cache) and prefix
caching across requests (hits, outliving the computing request, caching disabled).

Driven by the fake model runner in tests/conftest.py; `step` and `run_to_completion` check the plan
and the bookkeeping after every step (budgets, slots, exclusive writes, K/V read back, no leaks).
"""

import pytest

from pagedserve.scheduler import RequestStatus
from tests.conftest import (
    FakeModelRunner,
    RunLog,
    expected_output_token_ids,
    make_prompt,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from tests.scheduler.support import ref_counts

# ---- n > 1 through fork ------------------------------------------------------------------------


def add_parent_and_child(scheduler, num_prompt_tokens, max_tokens=6):
    parent = make_request("p", num_prompt_tokens, max_tokens=max_tokens, ignore_eos=True)
    child = make_request(
        "p#1",
        prompt_token_ids=parent.prompt_token_ids,
        parent_sequence_id="p",
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=1,
    )
    scheduler.add_request(parent)
    scheduler.add_request(child)
    return parent, child


@pytest.mark.parametrize(
    "num_prompt_tokens", [10, 8], ids=["partial_last_block", "full_last_block"]
)
def test_fork_child_waits_for_the_parent_prompt_then_shares_its_blocks_with_copy_on_write(
    num_prompt_tokens,
):
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    runner = FakeModelRunner(scheduler)
    parent, child = add_parent_and_child(scheduler, num_prompt_tokens)
    while parent.num_computed_tokens < parent.num_prompt_tokens:
        step(scheduler, runner)
        assert scheduler.fork_waiting == [child] and "p#1" not in scheduler.block_manager.tables
    prompt_blocks = list(scheduler.block_manager.block_ids("p"))
    plan = scheduler.schedule()
    # Exactly the block holding the last prompt token is written by both, so exactly it is copied.
    ((source, destination),) = plan.block_copies
    assert source == prompt_blocks[-1]
    refs, tables = ref_counts(scheduler), scheduler.block_manager.tables
    assert all(refs[b] == 2 for b in prompt_blocks[:-1]) and refs[source] == refs[destination] == 1
    last = len(prompt_blocks) - 1
    assert {tables["p"].block_ids[last], tables["p#1"].block_ids[last]} == {source, destination}
    assert tables["p"].block_ids[:last] == tables["p#1"].block_ids[:last] == prompt_blocks[:last]
    (scheduled,) = [s for s in plan.requests if s.sequence_id == "p#1"]
    assert scheduled.start_position == num_prompt_tokens - 1 and scheduled.needs_sample
    assert child.num_cached_tokens == num_prompt_tokens - 1
    scheduler.update_from_output(plan, runner.execute(plan))
    log = run_to_completion(scheduler, runner)
    assert log.finished["p"].output_token_ids == expected_output_token_ids(parent)
    assert log.finished["p#1"].output_token_ids == expected_output_token_ids(child)
    assert child.output_token_ids != parent.output_token_ids  # different seeds: real sharing tested


def test_children_waiting_on_their_parent_do_not_cap_its_prompt_chunks():
    # --long-prefill-token-threshold caps a prompt while others share the step; n > 1 children
    # cannot run before their parent's prompt, so they are no reason to slow it.
    scheduler = make_scheduler(
        num_blocks=64, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    runner = FakeModelRunner(scheduler)
    parent, child = add_parent_and_child(scheduler, 100)
    plan = step(scheduler, runner)
    assert [(s.sequence_id, s.num_new_tokens) for s in plan.requests] == [("p", 64)]
    log = run_to_completion(scheduler, runner)
    assert log.finished["p#1"].output_token_ids == expected_output_token_ids(child)


@pytest.mark.parametrize("num_steps", [0, 1], ids=["parent_waiting", "parent_mid_prefill"])
def test_fork_child_whose_parent_is_aborted_first_completes_on_its_own(num_steps):
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    runner = FakeModelRunner(scheduler)
    _, child = add_parent_and_child(scheduler, 12)
    for _ in range(num_steps):
        step(scheduler, runner)
    scheduler.abort_request("p")
    log = run_to_completion(scheduler, runner)
    assert child.status == RequestStatus.FINISHED_LENGTH
    assert log.finished["p#1"].output_token_ids == expected_output_token_ids(child)


def test_an_orphaned_child_waits_in_priority_order_behind_a_more_important_request():
    scheduler = make_scheduler(
        num_blocks=8, block_size=4, scheduling_policy="priority", max_num_batched_tokens=64
    )
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("blocker", 16, max_tokens=4, ignore_eos=True))
    step(scheduler, runner)
    low = make_request("low", 12, max_tokens=1, priority=9, ignore_eos=True)
    scheduler.add_request(low)
    scheduler.add_request(
        make_request(
            "low#1",
            prompt_token_ids=low.prompt_token_ids,
            parent_sequence_id="low",
            max_tokens=1,
            priority=9,
            ignore_eos=True,
        )
    )
    step(scheduler, runner)  # "low" prefills and finishes (max_tokens=1): its child is orphaned
    assert low.status == RequestStatus.FINISHED_LENGTH
    scheduler.add_request(make_request("high", 12, max_tokens=2, priority=0, ignore_eos=True))
    step(scheduler, runner)
    assert [request.sequence_id for request in scheduler.waiting] == ["low#1"]
    assert scheduler.requests["high"].status == RequestStatus.RUNNING
    run_to_completion(scheduler, runner)


def test_child_forked_after_the_parent_decoded_past_a_block_never_poisons_the_prefix_cache():
    # max_num_seqs=2 holds the child back until `x` finishes; by then the parent has decoded a
    # full block (positions 8..11). The child inherits that block's hash, so its own block at
    # 12..15 is cached under the parent's chain, and a prompt of parent[:12] + child[12:16]
    # reads K/V computed after the child's tokens 8..11.
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    runner, log = FakeModelRunner(scheduler), RunLog()
    parent = make_request("p", 8, max_tokens=20, ignore_eos=True)
    scheduler.add_request(parent)
    scheduler.add_request(make_request("x", 4, max_tokens=6, ignore_eos=True))
    child = make_request(
        "p#1",
        prompt_token_ids=parent.prompt_token_ids,
        parent_sequence_id="p",
        max_tokens=20,
        ignore_eos=True,
        seed=1,
    )
    scheduler.add_request(child)
    while child.num_computed_tokens < 16:
        step(scheduler, runner, log)
    mixed = parent.all_token_ids[:12] + child.all_token_ids[12:16] + [5]
    probe = make_request("probe", prompt_token_ids=mixed, max_tokens=2, ignore_eos=True)
    scheduler.add_request(probe)
    run_to_completion(scheduler, runner)  # fails: "probe reads K/V of another prefix"


def test_child_never_overwrites_a_cached_block_it_inherited_from_its_parent():
    # As above, but the parent is aborted right after the late fork: the child then holds the
    # parent's cached block of positions 8..11 alone (ref 1), writes its own tokens into it in
    # place, and a prompt of parent[:12] hits that block and reads the child's K/V.
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    runner = FakeModelRunner(scheduler)
    parent, child = add_parent_and_child(scheduler, 8, max_tokens=20)
    scheduler.add_request(make_request("x", 4, max_tokens=6, ignore_eos=True))
    while child.status != RequestStatus.RUNNING:
        step(scheduler, runner)
    parent_prefix = parent.all_token_ids[:12]
    scheduler.abort_request("p")
    while child.num_computed_tokens < 12:
        step(scheduler, runner)
    scheduler.add_request(make_request("probe", prompt_token_ids=parent_prefix + [5], max_tokens=2))
    run_to_completion(scheduler, runner)  # fails: "probe reads K/V of another prefix"


# ---- prefix caching ----------------------------------------------------------------------------


def test_second_request_with_the_same_prompt_reuses_the_cached_prefix():
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeModelRunner(scheduler)
    first = make_request("a", 17, max_tokens=4, ignore_eos=True)
    scheduler.add_request(first)
    step(scheduler, runner)
    second = make_request(
        "b", prompt_token_ids=first.prompt_token_ids, max_tokens=4, ignore_eos=True
    )
    scheduler.add_request(second)
    plan = step(scheduler, runner)
    (scheduled,) = [s for s in plan.requests if s.sequence_id == "b"]
    assert second.num_cached_tokens == 16
    assert scheduled.start_position == 16 and scheduled.num_new_tokens == 1
    assert scheduled.block_ids[:4] == scheduler.block_manager.block_ids("a")[:4]
    assert all(ref_counts(scheduler)[b] == 2 for b in scheduled.block_ids[:4])
    log = run_to_completion(scheduler, runner)
    assert log.finished["b"].output_token_ids == log.finished["a"].output_token_ids


def test_prefix_cache_statistics_count_each_admitted_request_once():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("hog", 16, max_tokens=4, ignore_eos=True))
    step(scheduler, runner)
    blocked = make_request("blocked", 16, max_tokens=2, ignore_eos=True)
    scheduler.add_request(blocked)
    step(scheduler, runner)
    assert blocked.status == RequestStatus.WAITING  # its admission is retried every step
    run_to_completion(scheduler, runner)
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (16 + 16, 0)


def test_cached_prefix_outlives_the_request_that_computed_it():
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeModelRunner(scheduler)
    first = make_request("a", 17, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    second = make_request("b", prompt_token_ids=first.prompt_token_ids, max_tokens=1)
    scheduler.add_request(second)
    log = run_to_completion(scheduler, runner)
    assert second.num_cached_tokens == 16 and log.plans[0].num_batched_tokens == 1


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    runner = FakeModelRunner(scheduler)
    prompt = make_prompt("salted", 17)
    tenant_a = make_request("a", prompt_token_ids=prompt, max_tokens=1, cache_salt="tenant-a")
    scheduler.add_request(tenant_a)
    run_to_completion(scheduler, runner)
    others = {
        "same-salt": make_request(
            "a2", prompt_token_ids=prompt, max_tokens=1, cache_salt="tenant-a"
        ),
        "other-salt": make_request(
            "b", prompt_token_ids=prompt, max_tokens=1, cache_salt="tenant-b"
        ),
        "no-salt": make_request("c", prompt_token_ids=prompt, max_tokens=1),
    }
    for request in others.values():
        scheduler.add_request(request)
        run_to_completion(scheduler, runner)
    hits = {name: request.num_cached_tokens for name, request in others.items()}
    assert hits == {"same-salt": 16, "other-salt": 0, "no-salt": 0}
    again = make_request("c2", prompt_token_ids=prompt, max_tokens=1)  # the unsalted chain is
    scheduler.add_request(again)  # cached now, by "c"
    run_to_completion(scheduler, runner)
    assert again.num_cached_tokens == 16


def test_no_prefix_hit_with_caching_disabled():
    scheduler = make_scheduler(num_blocks=32, block_size=4, enable_prefix_caching=False)
    first = make_request("a", 17, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    second = make_request("b", prompt_token_ids=first.prompt_token_ids, max_tokens=1)
    scheduler.add_request(second)
    log = run_to_completion(scheduler)
    assert second.num_cached_tokens == 0 and log.plans[0].num_batched_tokens == 17
