"""What the server asks of the engine between two steps, on the engine thread (the only thread
that may touch the bookkeeping): a snapshot of its state (/v1/engine/state, the dashboard), a
reset of the prefix cache (vLLM's /reset_prefix_cache, SGLang's /flush_cache), and the start and
end of a profile of its steps (/start_profile, /stop_profile)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.profiling import StepProfiler
from pagedserve.engine.state import EngineState, build_engine_state, take_engine_state

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

_STATE_TIMEOUT_S = 30.0  # a snapshot waits for at most the step in progress; this is a backstop


class BetweenSteps:
    """`AsyncEngine`'s calls that run between two steps (mixed in; it runs `_on_engine_thread`)."""

    _profiler: StepProfiler  # AsyncEngine's

    async def _on_engine_thread(self, call: Callable[[LLMEngine], Any]) -> Any:
        raise NotImplementedError  # AsyncEngine's

    async def engine_state(self) -> EngineState:
        """The block pool and queues, snapshotted on the engine thread between steps."""
        call = self._on_engine_thread(take_engine_state)
        try:
            raw = await asyncio.wait_for(call, _STATE_TIMEOUT_S)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise EngineDeadError("the engine did not answer a state request in time") from None
        return build_engine_state(raw)

    async def start_profile(self) -> None:
        """Trace the engine's steps from the next one on (engine/profiling.py); raises
        ProfilingError if a trace is running already."""
        await self._on_engine_thread(self._profiler.start)

    async def stop_profile(self, folder: Path) -> Path:
        """End the trace and write it into `folder`; returns its file."""
        return await self._on_engine_thread(lambda engine: self._profiler.stop(engine, folder))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block, if no request is queued or running (a running request's
        shared blocks must stay); returns whether the cache was reset."""
        return bool(await self._on_engine_thread(_reset_prefix_cache))


def _reset_prefix_cache(engine: LLMEngine) -> bool:
    if engine.has_unfinished_requests():
        return False
    return engine.block_manager.pool.reset_prefix_cache()
