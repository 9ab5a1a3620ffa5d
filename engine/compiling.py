"""Constrained requests while their grammar compiles, before they reach the engine thread
(`AsyncEngine`, mixed in).

A request's grammar is compiled on the grammar pool before the request is queued (neither the
event loop nor the engine thread waits), so an abort that arrives meanwhile (a client gone, SGLang's
/abort_request) would find nothing to abort in the engine and the request would run anyway. The
abort is remembered here instead, and the request ends as aborted without being queued.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pagedserve.engine.errors import EngineDeadError, EngineOverloadedError
from pagedserve.engine.inputs import ValidatedRequest
from pagedserve.engine.outputs import RequestDelta

if TYPE_CHECKING:
    import threading

    from pagedserve.engine.llm_engine import LLMEngine


class Compiling:
    """`AsyncEngine`'s compile step (its attributes, annotated here)."""

    _compiling: dict[str, bool]  # each request id compiling -> whether it was aborted meanwhile
    _stopping: threading.Event
    _dead_reason: str | None
    _engine: LLMEngine
    is_alive: bool

    async def _compiled(self, validated: ValidatedRequest) -> ValidatedRequest | None:
        """Compile the constraint on the grammar pool (cached): a malformed one, or one past its
        deadline, raises here, nothing queued. None: the request was aborted meanwhile."""
        constraint = validated.params.structured_outputs
        assert constraint is not None
        if validated.request_id in self._compiling:  # the same id compiling twice: as in flight
            raise EngineOverloadedError(f"request id {validated.request_id!r} is already in flight")
        self._compiling[validated.request_id] = False
        try:
            grammar = await self._engine.structured.compiler.compiled(constraint)
        finally:
            aborted = self._compiling.pop(validated.request_id)
        if aborted:
            return None
        if not self.is_alive or self._stopping.is_set():
            raise EngineDeadError(self._dead_reason or "the engine is not running")
        return dataclasses.replace(validated, grammar=grammar)

    def _abort_compiling(self, request_id: str) -> None:
        if request_id in self._compiling:
            self._compiling[request_id] = True


def aborted_unqueued(request: ValidatedRequest) -> list[RequestDelta]:
    """The final deltas of a request aborted before it was queued: every choice, nothing made."""
    return [
        RequestDelta(
            request.request_id,
            index,
            new_token_ids=(),
            new_text="",
            new_logprobs=None,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=0,
            finished=True,
            finish_reason="abort",
        )
        for index in range(request.params.n)
    ]
