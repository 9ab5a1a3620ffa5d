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

ANSWER_TIMEOUT_S = 30.0  # a call waits for at most the step in progress; this is a backstop


class BetweenSteps:
    """`AsyncEngine`'s calls that run between two steps (mixed in; it runs `_on_engine_thread`)."""

    _profiler: StepProfiler  # AsyncEngine's

    async def _on_engine_thread(self, call: Callable[[LLMEngine], Any]) -> Any:
        raise NotImplementedError  # AsyncEngine's

    async def _between_steps(self, call: Callable[[LLMEngine], Any], what: str) -> Any:
        """`call(engine)` on the engine thread; EngineDeadError (a 503) if a stuck engine does
        not answer within ANSWER_TIMEOUT_S."""
        try:
            return await asyncio.wait_for(self._on_engine_thread(call), ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise EngineDeadError(f"the engine did not answer {what} in time") from None

    async def engine_state(self) -> EngineState:
        """The block pool and queues, snapshotted on the engine thread between steps."""
        return build_engine_state(await self._between_steps(take_engine_state, "a state request"))

    async def start_profile(self, folder: Path) -> None:
        """Trace the engine's steps from the next one on, to be written into `folder`
        (engine/profiling.py); ProfilingError if a trace runs already or the folder cannot be
        made."""
        await self._between_steps(lambda engine: self._profiler.start(engine, folder), "a profile")

    async def stop_profile(self) -> Path:
        """End the trace (on the engine thread) and write it (off it: steps go on meanwhile);
        returns its file."""
        finished = await self._between_steps(lambda engine: self._profiler.stop(), "a profile")
        return await asyncio.to_thread(finished.write)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block, if no request is queued or running (a running request's
        shared blocks must stay); returns whether the cache was reset."""
        return bool(await self._between_steps(_reset_prefix_cache, "a cache reset"))


def _reset_prefix_cache(engine: LLMEngine) -> bool:
    if engine.has_unfinished_requests():
        return False
    return engine.block_manager.pool.reset_prefix_cache()
