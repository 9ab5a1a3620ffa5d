"""`AsyncEngine.engine_state`: a snapshot taken on the engine thread between steps, on a tiny random
model. While two requests with a shared prompt prefix run, their shared blocks report a ref count
of 2 and both owners; a snapshot is consistent (ref counts equal the tables holding each block);
after both finish every block is free or cached-free; a stopped engine answers EngineDeadError."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.configs import EngineConfig, SamplingParams
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.state import EngineState
from tests.engine.conftest import make_engine, make_tiny_model

BLOCK_SIZE = 4
PREFIX = [17, 300, 42, 999, 8, 64, 7, 5, 123, 456, 789, 11]  # three full blocks


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("llama-gqa", default_tokenizer, seed=1)


def started_engine(tiny_loaded) -> AsyncEngine:
    engine = make_engine(tiny_loaded, block_size=BLOCK_SIZE, num_kv_blocks=32)
    step = engine.step

    def slow_step():  # keeps the requests running while the test looks
        time.sleep(0.005)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(EngineConfig())
    async_engine.engine = engine
    return async_engine


def assert_consistent(state: EngineState) -> None:
    tables = {r.sequence_id: r.block_table for r in state.running}
    assert len(state.blocks()) == state.num_blocks
    for block in state.blocks():
        holders = sorted(
            sid for sid, table in tables.items() for bid in table if bid == block.block_id
        )
        assert sorted(block.owner_ids) == holders, block
        assert block.ref_count == len(holders), block
        expected = "in_use" if block.ref_count else "cached" if block.is_hashed else "free"
        assert block.state == expected, block
    assert state.num_free_blocks == sum(b.state != "in_use" for b in state.blocks())


def test_engine_state_shows_shared_prefix_blocks_and_all_free_after_finishing(tiny_loaded):
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)

    async def scenario() -> tuple[EngineState, EngineState]:
        engine = started_engine(tiny_loaded)
        await engine.start()
        first = engine.generate(PREFIX + [1, 2], params, "a")
        await anext(first)  # a's prompt is computed and its full blocks are in the prefix cache
        second = engine.generate(PREFIX + [3], params, "b")
        await anext(second)
        during = await engine.engine_state()
        for stream in (first, second):
            async for _ in stream:
                pass
        after = await engine.engine_state()
        await engine.shutdown()
        return during, after

    during, after = asyncio.run(scenario())

    assert_consistent(during)
    a, b = sorted(during.running, key=lambda r: r.sequence_id)
    assert a.block_table[:3] == b.block_table[:3]  # the shared prefix: the same physical blocks
    assert b.num_cached_tokens == 3 * BLOCK_SIZE
    for block_id in a.block_table[:3]:
        block = during.blocks()[block_id]
        assert (block.ref_count, sorted(block.owner_ids), block.is_hashed) == (
            2,
            ["a#0", "b#0"],
            True,
        )
    assert during.last_plan is not None and during.num_steps > 0
    assert {p.sequence_id for p in during.last_plan.requests} <= {"a#0", "b#0"}

    assert_consistent(after)
    assert after.running == after.waiting == []
    assert {b.state for b in after.blocks()} <= {"free", "cached"}
    assert any(b.state == "cached" for b in after.blocks())
    assert after.num_free_blocks == after.num_blocks
    assert after.stats.num_generation_tokens == 120


def test_engine_state_of_a_stopped_engine_is_engine_dead(tiny_loaded):
    async def scenario() -> None:
        engine = started_engine(tiny_loaded)
        await engine.start()
        state = await engine.engine_state()
        assert state.running == [] and state.num_free_blocks == state.num_blocks
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await engine.engine_state()

    asyncio.run(scenario())
