"""The scheduler under block pressure: everything finishes, outputs match an unconstrained run,
preemption happens, the oldest request is never starved, and random workloads keep every invariant.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.scheduler import RequestStatus
from tests.conftest import (
    FakeModelRunner,
    RunLog,
    check_all_free,
    expected_output_token_ids,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def add_workload(scheduler, seed, num_requests=32, priorities=False):
    """32 requests, prompts 10-40 tokens, 20-60 new tokens, ignore_eos; returns them in arrival order."""
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        request = make_request(
            f"r{index}",
            rng.randint(10, 40),
            max_tokens=rng.randint(20, 60),
            ignore_eos=True,
            arrival_time=index,
            priority=rng.randint(0, 3) if priorities else 0,
        )
        scheduler.add_request(request)
        requests.append(request)
    return requests


def outputs(log: RunLog) -> dict[str, list[int]]:
    return {request_id: request.output_token_ids for request_id, request in log.finished.items()}


@pytest.mark.parametrize(
    "enable_prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"]
)
@pytest.mark.parametrize("budget", [64, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_32_requests_in_24_blocks_finish_with_the_unconstrained_outputs_and_no_starvation(
    seed, budget, enable_prefix_caching
):
    settings_ = dict(
        max_num_batched_tokens=budget,
        max_num_seqs=64,
        max_model_len=200,
        enable_prefix_caching=enable_prefix_caching,
    )
    unconstrained = make_scheduler(num_blocks=1000, block_size=4, **settings_)
    add_workload(unconstrained, seed)
    reference = run_to_completion(unconstrained)
    assert unconstrained.num_preemptions == 0

    scheduler = make_scheduler(num_blocks=24, block_size=4, **settings_)
    requests = add_workload(scheduler, seed)
    log = run_to_completion(scheduler)

    assert len(log.finished) == 32 and outputs(log) == outputs(reference)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.output_token_ids == expected_output_token_ids(r) for r in requests)
    assert scheduler.num_preemptions >= 1
    assert scheduler.num_preemptions == sum(len(plan.preempted_sequence_ids) for plan in log.plans)
    oldest = requests[0]
    assert oldest.num_preemptions == 0
    # The oldest runs every step: its prompt in ceil(prompt / budget) chunks, then one token a step.
    assert (
        log.finish_step["r0"] <= -(-oldest.num_prompt_tokens // budget) + oldest.num_output_tokens
    )
    check_all_free(scheduler)


def test_highest_priority_request_is_never_starved_under_the_priority_policy():
    scheduler = make_scheduler(
        num_blocks=24,
        block_size=4,
        max_num_seqs=64,
        max_model_len=200,
        scheduling_policy="priority",
    )
    requests = add_workload(scheduler, seed=3, priorities=True)
    log = run_to_completion(scheduler)
    assert len(log.finished) == 32 and scheduler.num_preemptions >= 1
    assert all(r.output_token_ids == expected_output_token_ids(r) for r in requests)
    first = min(requests, key=lambda r: (r.priority, r.arrival_time))
    assert first.num_preemptions == 0
    assert log.finish_step[first.sequence_id] <= first.num_output_tokens + 1


def test_oldest_request_finishes_in_bounded_steps_while_new_requests_keep_arriving():
    scheduler = make_scheduler(
        num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=200
    )
    runner, log, rng = FakeModelRunner(scheduler), RunLog(), random.Random(7)
    oldest = make_request("oldest", 30, max_tokens=50, ignore_eos=True)
    scheduler.add_request(oldest)
    for index in range(200):
        if rng.random() < 0.5:
            scheduler.add_request(
                make_request(
                    f"n{index}", rng.randint(4, 30), max_tokens=rng.randint(5, 40), ignore_eos=True
                )
            )
        step(scheduler, runner, log)
    assert log.finish_step["oldest"] <= 1 + oldest.num_output_tokens
    assert scheduler.num_preemptions >= 1
    log = run_to_completion(scheduler, runner)
    assert all(r.output_token_ids == expected_output_token_ids(r) for r in log.finished.values())


def test_forked_choices_under_pressure_all_finish_with_their_own_outputs():
    scheduler = make_scheduler(
        num_blocks=24, block_size=4, max_num_batched_tokens=16, max_model_len=200
    )
    rng, requests = random.Random(5), []
    for index in range(6):
        parent = make_request(f"p{index}", rng.randint(6, 20), max_tokens=20, ignore_eos=True)
        requests.append(parent)
        for choice in (1, 2):
            requests.append(
                make_request(
                    f"p{index}#{choice}",
                    prompt_token_ids=parent.prompt_token_ids,
                    max_tokens=20,
                    ignore_eos=True,
                    parent_sequence_id=parent.sequence_id,
                    seed=choice,
                )
            )
    for request in requests:
        scheduler.add_request(request)
    log = run_to_completion(scheduler)
    assert len(log.finished) == 18 and scheduler.num_preemptions >= 1
    assert any(plan.block_copies for plan in log.plans)
    assert all(r.output_token_ids == expected_output_token_ids(r) for r in requests)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(8, 40))
    capacity = num_blocks * block_size
    specs = []
    for _ in range(draw(st.integers(1, 12))):
        num_prompt_tokens = draw(st.integers(1, min(40, capacity - 1)))
        max_tokens = draw(st.integers(1, min(30, capacity - num_prompt_tokens)))
        specs.append(
            (
                num_prompt_tokens,
                max_tokens,
                draw(st.integers(0, 2)),  # priority
                draw(st.sampled_from([None, None, 0])),  # fork from the request at this index
                draw(st.integers(0, 25)),  # arrival step
                draw(
                    st.sampled_from([None, None, None, 2, 9])
                ),  # abort this many steps after arrival
            )
        )
    config = dict(
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(1, 8)),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
    )
    return num_blocks, block_size, config, specs


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_random_workloads_keep_every_invariant_and_leak_no_block(workload):
    num_blocks, block_size, config, specs = workload
    scheduler = make_scheduler(num_blocks, block_size, max_model_len=256, **config)
    runner, log, requests, aborted = FakeModelRunner(scheduler), RunLog(), [], set()
    for now in range(2000):
        for index, (num_prompt, max_tokens, priority, fork_of, arrival, abort_after) in enumerate(
            specs
        ):
            if arrival == now:
                parent = requests[fork_of] if fork_of is not None and requests else None
                request = make_request(
                    f"r{index}",
                    num_prompt,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    priority=priority,
                    prompt_token_ids=parent.prompt_token_ids if parent else None,
                    seed=index,
                    parent_sequence_id=parent.sequence_id if parent else None,
                )
                if (
                    parent is not None
                    and parent.num_prompt_tokens + max_tokens > num_blocks * block_size
                ):
                    continue
                scheduler.add_request(request)
                requests.append(request)
            if (
                abort_after is not None
                and now == arrival + abort_after
                and scheduler.abort_request(f"r{index}")
            ):
                aborted.add(f"r{index}")
        if now > 25 and not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner, log)
    check_all_free(scheduler)
    for request in requests:
        assert request.is_finished
        if request.sequence_id not in aborted:
            assert request.output_token_ids == expected_output_token_ids(request)
