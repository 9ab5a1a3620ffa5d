"""`snapshot_scheduler`: the queues in serve order with each sequence's progress and block table,
and `snapshot_plan`: a plan's tokens per sequence, as plain values taken between steps."""

from pagedserve.scheduler.snapshot import snapshot_plan, snapshot_scheduler
from tests.conftest import FakeModelRunner, make_request, make_scheduler, run_to_completion, step


def test_snapshot_before_any_step_lists_waiting_requests_without_blocks():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 5))

    snapshot = snapshot_scheduler(scheduler)

    assert snapshot.running == []
    assert [r.sequence_id for r in snapshot.waiting] == ["a", "b"]
    assert [r.status for r in snapshot.waiting] == ["waiting", "waiting"]
    assert snapshot.waiting[0].block_table == []
    assert snapshot.waiting[0].num_cached_tokens == 0


def test_snapshot_after_a_step_has_block_tables_progress_and_tokens_per_request():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 6, max_tokens=4, ignore_eos=True))
    scheduler.add_request(make_request("b", 5, max_tokens=4, ignore_eos=True))
    runner = FakeModelRunner(scheduler)
    plan = step(scheduler, runner)  # both prompts in one step: a gets blocks 0-1, b blocks 2-3

    snapshot = snapshot_scheduler(scheduler)

    a, b = snapshot.running
    assert (a.sequence_id, a.status, a.block_table) == ("a", "running", [0, 1])
    assert (b.sequence_id, b.block_table) == ("b", [2, 3])
    assert (a.num_prompt_tokens, a.num_output_tokens, a.num_computed_tokens) == (6, 1, 6)
    plan = snapshot_plan(plan, token_budget=64)
    assert [(p.sequence_id, p.num_new_tokens, p.start_position) for p in plan.requests] == [
        ("a", 6, 0),
        ("b", 5, 0),
    ]
    assert plan.num_batched_tokens == 11
    assert plan.token_budget == 64

    decodes = snapshot_plan(step(scheduler, runner), token_budget=64)  # two decodes
    assert [(p.sequence_id, p.num_new_tokens) for p in decodes.requests] == [
        ("a", 1),
        ("b", 1),
    ]


def test_snapshot_shows_a_preempted_request_waiting_with_no_blocks():
    # 4 blocks of 4: a and b each take 2 for their prompt; the next decode of both needs a third.
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("a", 8, max_tokens=6, ignore_eos=True))
    scheduler.add_request(make_request("b", 8, max_tokens=6, ignore_eos=True))
    runner = FakeModelRunner(scheduler)
    step(scheduler, runner)
    step(scheduler, runner)  # a grows into b's blocks: b is preempted

    snapshot = snapshot_scheduler(scheduler)

    assert [r.sequence_id for r in snapshot.running] == ["a"]
    (b,) = snapshot.waiting
    assert (b.sequence_id, b.status, b.num_preemptions, b.block_table) == ("b", "preempted", 1, [])
    assert b.num_computed_tokens == 0
    assert snapshot.num_preemptions == 1
    run_to_completion(scheduler, runner)
    assert snapshot_scheduler(scheduler).running == snapshot_scheduler(scheduler).waiting == []


def test_snapshot_is_not_changed_by_later_steps():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", 6, max_tokens=8, ignore_eos=True))
    runner = FakeModelRunner(scheduler)
    step(scheduler, runner)
    snapshot = snapshot_scheduler(scheduler)
    for _ in range(4):
        step(scheduler, runner)
    (a,) = snapshot.running
    assert (a.num_computed_tokens, a.num_output_tokens, a.block_table) == (6, 1, [0, 1])
