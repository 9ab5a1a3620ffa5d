"""AsyncEngine's bridge between the engine thread and asyncio, on a tiny random model: a request
id reused right after its stream was closed early never receives the old request's deltas, and a
request that arrives while the engine shuts down is refused instead of waiting forever, and a
request's priority reaches the scheduler (under the priority policy only); the model is loaded
on the thread that steps it, and a load that fails fails start()."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import pytest

from pagedserve.configs import EngineConfig, SamplingParams, StructuredOutputs
from pagedserve.engine import async_engine as async_engine_module
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from pagedserve.engine.profiling import ProfilingError
from tests.engine.conftest import make_engine, make_tiny_model

PROMPT = [17, 300, 42, 999, 8, 64, 7]


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("llama-gqa", default_tokenizer, seed=1)


def started_engine(tiny_loaded, step_delay_s: float = 0.0, policy: str = "fcfs") -> AsyncEngine:
    engine = make_engine(tiny_loaded, block_size=4, scheduling_policy=policy)
    if step_delay_s:
        step = engine.step

        def slow_step():  # keeps a long request running while the test acts
            time.sleep(step_delay_s)
            return step()

        engine.step = slow_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(EngineConfig(scheduler={"scheduling_policy": policy}))
    async_engine.engine = engine  # start() loads a model only when none is given
    return async_engine


def test_a_request_id_reused_after_an_early_close_gets_only_its_own_deltas(tiny_loaded):
    async def scenario() -> list:
        engine = started_engine(tiny_loaded, step_delay_s=0.01)
        await engine.start()
        old = engine.generate(
            PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "x"
        )
        await anext(old)
        await old.aclose()  # the client went away: "x" is aborted by the engine thread
        for _ in range(1000):  # the id is refused until that abort has been processed
            new = engine.generate(
                PROMPT[:3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "x"
            )
            try:
                deltas = [await anext(new)]
                break
            except EngineOverloadedError:
                await asyncio.sleep(0.005)
        else:
            pytest.fail("the id stayed refused after its abort")
        deltas += [delta async for delta in new]
        await engine.shutdown()
        return deltas

    deltas = asyncio.run(scenario())
    assert sum(len(delta.new_token_ids) for delta in deltas) == 3
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert deltas[-1].num_output_tokens == 3


def test_the_prefix_cache_is_reset_between_steps_only_while_nothing_is_in_flight(tiny_loaded):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def cached_tokens(engine: AsyncEngine, request_id: str) -> int:
        deltas = [delta async for delta in engine.generate(PROMPT * 3, params, request_id)]
        return deltas[-1].num_cached_prompt_tokens

    async def scenario() -> tuple:
        engine = started_engine(tiny_loaded, step_delay_s=0.01)
        await engine.start()
        cold, warm = await cached_tokens(engine, "a"), await cached_tokens(engine, "b")
        long = engine.generate(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), "long")
        await anext(long)
        busy = await engine.reset_prefix_cache()  # "long" holds blocks: refused
        await long.aclose()
        while not await engine.reset_prefix_cache():  # once its abort has been processed
            await asyncio.sleep(0.01)
        after = await cached_tokens(engine, "c")
        await engine.shutdown()
        return cold, warm, busy, after

    cold, warm, busy, after = asyncio.run(scenario())
    assert (cold, warm, busy, after) == (0, 20, False, 0)  # 21 tokens: 5 full blocks of 4


def test_an_abort_while_the_grammar_compiles_ends_the_request_before_it_is_queued(tiny_loaded):
    constraint = StructuredOutputs("regex", "(yes|no)")
    params = SamplingParams(max_tokens=5, structured_outputs=constraint)

    async def scenario() -> tuple:
        engine = started_engine(tiny_loaded)
        await engine.start()
        compiler = engine.engine.structured.compiler
        compile_now, release = compiler.compiled, asyncio.Event()

        async def slow_compile(constraint):  # as a long compile on the pool would
            await release.wait()
            return await compile_now(constraint)

        compiler.compiled = slow_compile
        stream = engine.generate(PROMPT, params, "compiling")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        await engine.abort("compiling")
        release.set()
        deltas = [await first] + [delta async for delta in stream]
        queued = engine.engine.has_unfinished_requests()
        await engine.shutdown()
        return deltas, queued

    deltas, queued = asyncio.run(scenario())
    assert [(d.finished, d.finish_reason, d.new_token_ids) for d in deltas] == [(True, "abort", ())]
    assert not queued


def test_a_profile_traces_the_steps_between_start_and_stop(tiny_loaded, tmp_path):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # no folder can be made under a file

    async def scenario() -> tuple:
        engine = started_engine(tiny_loaded)
        await engine.start()
        with pytest.raises(ProfilingError, match="no profile is running"):
            await engine.stop_profile()
        with pytest.raises(ProfilingError, match="cannot make the profile folder"):
            await engine.start_profile(blocked / "traces")
        await engine.start_profile(tmp_path / "traces")
        with pytest.raises(ProfilingError, match="already running"):
            await engine.start_profile(tmp_path / "traces")
        deltas = [delta async for delta in engine.generate(PROMPT, params, "traced")]
        trace = await engine.stop_profile()
        await engine.shutdown()
        return deltas, trace

    deltas, trace = asyncio.run(scenario())
    assert deltas[-1].num_output_tokens == 3
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "pagedserve::paged_attention" in names  # the engine thread's steps, kernel included
    assert any(str(name).startswith("aten::") for name in names)


def test_a_call_between_steps_that_gets_no_answer_is_engine_dead_not_a_hang(
    tiny_loaded, monkeypatch
):
    monkeypatch.setattr("pagedserve.engine.between_steps.ANSWER_TIMEOUT_S", 0.2)

    async def scenario() -> None:
        engine = started_engine(tiny_loaded, step_delay_s=2.0)  # a step far longer than that
        await engine.start()
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), "slow")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)  # the engine thread is inside its slow step
        with pytest.raises(EngineDeadError, match="did not answer a cache reset in time"):
            await engine.reset_prefix_cache()
        first.cancel()
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_request_arriving_during_shutdown_is_refused_not_left_waiting(tiny_loaded):
    async def scenario() -> None:
        engine = started_engine(tiny_loaded)
        await engine.start()
        shutdown = asyncio.create_task(engine.shutdown())
        await asyncio.sleep(0)  # shutdown() has told the thread to stop
        late = engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0), "late")
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(anext(late), timeout=5)
        await shutdown

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_priority_reaches_the_scheduler_only_under_the_priority_policy(tiny_loaded, policy):
    async def scenario() -> int | None:
        engine = started_engine(tiny_loaded, step_delay_s=0.01, policy=policy)
        await engine.start()
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True), "p", -3)
        try:
            await anext(stream)
            return engine.engine.scheduler.requests["p#0"].priority
        finally:
            await stream.aclose()
            await engine.shutdown()

    if policy == "fcfs":
        with pytest.raises(InvalidRequestError, match="scheduling-policy priority"):
            asyncio.run(scenario())
    else:
        assert asyncio.run(scenario()) == -3


def test_when_the_engine_loop_dies_open_streams_fail_and_the_engine_reports_dead(tiny_loaded):
    async def scenario() -> None:
        engine = started_engine(tiny_loaded, step_delay_s=0.01)
        await engine.start()
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), "victim")
        await anext(stream)

        def broken_step():
            raise RuntimeError("injected: the scheduler's state is corrupt")

        engine.engine.step = broken_step  # a failure outside any one request: the loop dies
        with pytest.raises(EngineDeadError, match="engine loop died"):
            async for _ in stream:
                pass
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(PROMPT, SamplingParams(max_tokens=2), "after"))

    asyncio.run(scenario())


def test_the_engine_thread_loads_the_model_it_then_steps(tiny_loaded, monkeypatch):
    """One thread owns torch: a model built on another thread leaves a second OpenMP team behind,
    and libgomp then parks its workers between regions (a serving step ran ~2x slower)."""
    threads: dict[str, str] = {}

    def load_here(config):
        threads["load"] = threading.current_thread().name
        engine = make_engine(tiny_loaded, block_size=4)
        step = engine.step

        def recorded_step():
            threads["step"] = threading.current_thread().name
            return step()

        engine.step = recorded_step  # type: ignore[method-assign]
        return engine

    monkeypatch.setattr(async_engine_module, "LLMEngine", load_here)

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig())
        await engine.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            async for _ in engine.generate(PROMPT, params, "r"):
                pass
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
    assert threads == {"load": "pagedserve-engine", "step": "pagedserve-engine"}


def test_a_model_that_fails_to_load_fails_start_and_the_engine_reports_dead(monkeypatch):
    def broken_load(config):
        raise OSError("injected: no such model folder")

    monkeypatch.setattr(async_engine_module, "LLMEngine", broken_load)

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig())
        with pytest.raises(OSError, match="no such model folder"):
            await engine.start()
        assert not engine.is_alive
        with pytest.raises(EngineDeadError, match="failed to start"):
            await anext(engine.generate(PROMPT, SamplingParams(max_tokens=2), "after"))

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("started", "error", "fragment"),
    [
        (True, InvalidRequestError, "did not compile within 0.05 s"),  # running: too costly
        (False, EngineOverloadedError, "grammar compiler is busy"),  # queued behind others
    ],
)
def test_a_compile_past_its_deadline_fails_the_request_and_keeps_running_for_others(
    tiny_loaded, started, error, fragment
):
    compile_future: concurrent.futures.Future = concurrent.futures.Future()
    if started:
        compile_future.set_running_or_notify_cancel()

    async def scenario() -> None:
        engine = started_engine(tiny_loaded)
        await engine.start()
        engine.engine.structured.compiler.timeout_s = 0.05
        engine.engine.structured.compiler.submit = lambda constraint: compile_future
        constraint = StructuredOutputs("regex", "[ab]+", "guided_regex")
        params = SamplingParams(max_tokens=2, temperature=0, structured_outputs=constraint)
        with pytest.raises(error, match=fragment) as raised:
            # Bounded here too: without the deadline, the wait would never end.
            await asyncio.wait_for(anext(engine.generate(PROMPT, params, "constrained")), 10)
        if error is InvalidRequestError:
            assert raised.value.param == "guided_regex"
        # The shared compile was not cancelled with the request; the engine still serves.
        assert not compile_future.cancelled()
        plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        deltas = [delta async for delta in engine.generate(PROMPT, plain, "plain")]
        assert deltas[-1].finished
        await engine.shutdown()

    asyncio.run(scenario())
