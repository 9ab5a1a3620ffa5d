"""`EngineClient`: the surface the HTTP server uses. `AsyncEngine` implements it; tests fake it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from pagedserve.configs import SamplingParams
from pagedserve.engine.classifier import ClassifierHead
from pagedserve.engine.outputs import EngineStats, RequestDelta
from pagedserve.engine.state import EngineState


class EngineClient(Protocol):
    model_name: str  # the served model name (the first of served_model_names)
    served_model_names: tuple[str, ...]  # every name a request may give as its model
    max_model_len: int
    vocab_size: int
    max_waiting_requests: int  # engine requests (prompts) in flight at once; more get a 429
    tokenizer: Any  # a transformers tokenizer: encode/decode/apply_chat_template
    sampling_defaults: dict[str, float | int]  # the model's, for fields a request leaves out
    eos_token_ids: tuple[int, ...]  # where the engine ends a choice (its generation config's)
    lora_adapters: dict[str, str]  # each served LoRA adapter's name and folder
    classifier: ClassifierHead | None  # a sequence classifier's head (engine/classifier.py)

    @property
    def is_alive(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Validate and queue the request (raising InvalidRequestError / EngineOverloadedError /
        EngineDeadError before the first yield), then yield deltas for every choice until each is
        finished. Closing or cancelling the iterator aborts the request and frees its blocks.
        `priority` (lower first) needs the priority scheduling policy; else it must be 0."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def engine_state(self) -> EngineState:
        """The block pool and the queues between two steps (raises EngineDeadError if down)."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block if no request is queued or running; whether it did."""
        ...

    async def start_profile(self, folder: Path) -> None:
        """Trace the engine's steps into `folder` (engine/profiling.py); ProfilingError if one
        runs already or the folder cannot be made."""
        ...

    async def stop_profile(self) -> Path:
        """End the trace, write it and return its file; ProfilingError if none runs."""
        ...

    async def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Serve a PEFT folder as adapter `name` (engine/runtime_lora.py); raises LoRAError."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop taking requests for adapter `name`; raises KeyError if it is not served."""
        ...

    def drain_step_token_counts(self) -> list[int]:
        """Tokens scheduled in each engine step since the last call (for a histogram)."""
        ...

    def drain_grammar_mask_times(self) -> list[float]:
        """Seconds spent filling and applying grammar masks, per step that had a constrained row,
        since the last call (for a histogram)."""
        ...
