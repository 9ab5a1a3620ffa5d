"""`AsyncEngine`: runs the `LLMEngine` step loop on one dedicated thread and bridges it to asyncio.

The event loop sends add/abort commands through a thread-safe queue; the engine thread is the only
one that touches the scheduler, the block manager and the cache. Each step's deltas come back with
one `call_soon_threadsafe` into per-request `asyncio.Queue`s. Closing a request's async iterator
(client gone, task cancelled) aborts it, which frees its blocks within one step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.configs import EngineConfig, SamplingParams
from pagedserve.engine.between_steps import BetweenSteps
from pagedserve.engine.compiling import Compiling, aborted_unqueued
from pagedserve.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    RequestFailedError,
)
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import EngineStats, RequestDelta
from pagedserve.engine.profiling import StepProfiler
from pagedserve.engine.runtime_lora import RuntimeLoRA

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle engine thread blocks on its command queue


def _engine_attribute(name: str) -> property:
    """A read-only attribute of the running `LLMEngine` (EngineDeadError before it is built)."""
    return property(lambda self: getattr(self._engine, name), doc=f"The engine's {name}.")


class AsyncEngine(RuntimeLoRA, BetweenSteps, Compiling):
    """Implements `engine.client.EngineClient` over a threaded `LLMEngine`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine: LLMEngine | None = None
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[RequestDelta | Exception]] = {}
        # Ids of streams closed early whose abort the engine thread has not processed yet: reusing
        # one before then would hand the new stream the old request's last deltas.
        self._closing: set[str] = set()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._dead_reason: str | None = None
        self._pending_calls: set[asyncio.Future[Any]] = set()  # answered by the engine thread
        self._compiling: dict[str, bool] = {}  # engine/compiling.py
        self._profiler = StepProfiler()  # engine/between_steps.py

    # ---- EngineClient surface --------------------------------------------------------------
    model_name = _engine_attribute("model_name")
    max_model_len = _engine_attribute("max_model_len")
    vocab_size = _engine_attribute("vocab_size")
    tokenizer = _engine_attribute("tokenizer")
    sampling_defaults = _engine_attribute("sampling_defaults")
    eos_token_ids = _engine_attribute("eos_token_ids")
    classifier = _engine_attribute("classifier")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.config.model.served_model_names

    @property
    def max_waiting_requests(self) -> int:
        return self.config.scheduler.max_waiting_requests

    @property
    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise EngineDeadError("the engine has not been started")
        return self.engine

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_reason is None

    async def start(self) -> None:
        """Start the engine thread: it loads the model (the event loop stays free), then steps.
        One thread for both on purpose: OpenMP keeps a team of workers per thread that ran a
        parallel region, and with two teams (more threads than CPUs) libgomp parks its workers
        between regions, so every step ran ~2x slower (52.6 vs 27.9 ms; benchmarks/RESULTS.md)."""
        self._loop = asyncio.get_running_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="pagedserve-engine")
        self._thread.daemon = True
        self._thread.start()
        await asyncio.wrap_future(ready)  # a load that failed raises here

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort what is still running (each stream gets its final event), then stop the thread."""
        if self._thread is None:
            return
        for request_id in list(self._streams):
            self._commands.put(("abort", request_id))
        self._stopping.set()
        self._commands.put(("wake", None))
        await asyncio.to_thread(self._thread.join, timeout_s)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        if not self.is_alive or self._stopping.is_set():
            raise EngineDeadError(self._dead_reason or "the engine is not running")
        # Every check once, here: raises before anything is queued (the thread queues what passed).
        validated = self._engine.validate_request(
            request_id, prompt_token_ids, params, time.monotonic(), priority
        )
        if params.structured_outputs is not None:
            compiled = await self._compiled(validated)
            if compiled is None:  # aborted while its grammar compiled: it was never queued
                for delta in aborted_unqueued(validated):
                    yield delta
                return
            validated = compiled
        if len(self._streams) >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self._streams)} requests are in flight; retry later")
        if request_id in self._streams or request_id in self._closing:
            raise EngineOverloadedError(f"request id {request_id!r} is already in flight")
        stream: asyncio.Queue[RequestDelta | Exception] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(("add", validated))
        num_finished = 0
        try:
            while num_finished < params.n:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                num_finished += item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if num_finished < params.n:  # closed early: client gone, cancelled, or failed
                self._closing.add(request_id)
                self._commands.put(("close", request_id))

    async def abort(self, request_id: str) -> None:
        self._abort_compiling(request_id)
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._engine.stats() if self.engine is not None else EngineStats()

    async def _on_engine_thread(self, call: Any) -> Any:
        """`call(engine)`, run on the engine thread between two steps; its result or exception."""
        if not self.is_alive or self._loop is None:
            raise EngineDeadError(self._dead_reason or "the engine is not running")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending_calls.add(future)
        self._commands.put(("call", (future, call)))
        try:
            return await future
        finally:
            self._pending_calls.discard(future)

    def drain_step_token_counts(self) -> list[int]:
        return _drain(self.engine.step_token_counts if self.engine is not None else None)

    def drain_grammar_mask_times(self) -> list[float]:
        return _drain(self.engine.structured.mask_times_s if self.engine is not None else None)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        try:  # build the engine unless one was given, then read the grammar vocabulary
            if self.engine is None:
                self.engine = LLMEngine(self.config)
            engine = self.engine
            engine.structured.compiler.prepare()
        except BaseException as error:  # noqa: BLE001 - handed to start(), which raises it
            self._dead_reason = f"the engine failed to start: {type(error).__name__}"
            ready.set_exception(error)
            return
        ready.set_result(None)
        try:
            while not self._stopping.is_set() or engine.has_unfinished_requests():
                deltas = self._apply_commands(block=not engine.has_unfinished_requests())
                if engine.has_unfinished_requests():
                    deltas += engine.step()
                self._drop_retired_adapters(engine)
                if deltas:
                    self._call_in_loop(self._put_all, deltas)
        except BaseException as error:  # noqa: BLE001 - the loop's last line of defence
            logger.exception("engine loop died")
            self._dead_reason = f"engine loop died: {type(error).__name__}"
            self._call_in_loop(self._fail_all, EngineDeadError(self._dead_reason))
            return
        # Shut down. A request whose "add" raced the stop never reached the engine: end its stream.
        self._call_in_loop(self._fail_all, EngineDeadError("the engine has shut down"))

    def _apply_commands(self, block: bool) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        try:
            command, payload = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
            while True:
                deltas += self._apply(command, payload)
                command, payload = self._commands.get_nowait()
        except queue.Empty:
            return deltas

    def _apply(self, command: str, payload: Any) -> list[RequestDelta]:
        engine = self._engine
        if command == "add":
            try:
                engine.add_validated_request(payload)
            except EngineError as error:  # the request's own fault (its id is in use): as is
                self._send_error(payload.request_id, error)
            except Exception as error:  # noqa: BLE001 - a bug, reported to that request only
                logger.exception("request %s: add_request failed", payload.request_id)
                # The type only: the message may hold internals; the log has the traceback.
                self._send_error(
                    payload.request_id,
                    RequestFailedError(
                        "The engine could not accept the request "
                        f"({type(error).__name__}); see the server log."
                    ),
                )
            return []
        if command == "abort":
            return engine.abort_request(payload)
        if command == "call":
            future, call = payload
            try:
                result = call(engine)
            except Exception as error:  # noqa: BLE001 - the caller's to handle
                result = error
            self._call_in_loop(_settle, future, result)
            return []
        if command == "close":  # nobody reads its deltas any more; after the abort, free the id
            engine.abort_request(payload)
            self._call_in_loop(self._closing.discard, payload)
        return []

    def _send_error(self, request_id: str, error: Exception) -> None:
        self._call_in_loop(self._put, request_id, error)

    def _call_in_loop(self, callback: Any, *args: Any) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %s", getattr(callback, "__name__", callback))

    def _put_all(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            self._put(delta.request_id, delta)

    def _put(self, request_id: str, item: RequestDelta | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:  # else the client is gone and its abort is queued
            stream.put_nowait(item)

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._pending_calls:
            _settle(future, error)


def _drain(items: Any) -> list[Any]:
    drained = []
    while items:
        drained.append(items.popleft())  # deque pops are atomic: safe across threads
    return drained


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    """Resolve `future` (on its loop) unless its waiter already gave up."""
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
