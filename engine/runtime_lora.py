"""Loading and unloading LoRA adapters while serving: vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter (server/routes/lora.py, behind --allow-runtime-lora-updating).

The adapters (engine/lora.py) belong to the engine thread, so a load or an unload runs there,
between two steps: no step sees an adapter half installed. An unloaded or replaced adapter stops
taking new requests at once; its terms are freed after the step in which its last request ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedserve.engine.lora import LoRAAdapters, LoRAError

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine


class RuntimeLoRA:
    """`AsyncEngine`'s LoRA surface (mixed in; it runs `_on_engine_thread`)."""

    engine: LLMEngine | None

    async def _on_engine_thread(self, call: Callable[[LLMEngine], Any]) -> Any:
        raise NotImplementedError  # AsyncEngine's

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Each served LoRA adapter's name and folder (empty without --enable-lora)."""
        adapters = self.engine.runner.lora if self.engine is not None else None
        return adapters.paths if adapters is not None else {}

    async def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Serve the PEFT folder `path` as `name` from the next step on (replacing a served one
        of that name only with `replace`); raises LoRAError, changing nothing, if it cannot."""
        await self._on_engine_thread(lambda engine: _adapters(engine).load(name, path, replace))

    async def unload_lora_adapter(self, name: str) -> None:
        """New requests may no longer name `name`; those running it finish with it. Raises
        KeyError if no adapter of that name is served."""
        await self._on_engine_thread(lambda engine: _adapters(engine).unload(name))

    @staticmethod
    def _drop_retired_adapters(engine: LLMEngine) -> None:
        """After a step (engine thread): free the terms no unfinished request runs any more."""
        if engine.runner.lora is not None:
            engine.runner.lora.drop_retired(engine.scheduler.requests.values())


def _adapters(engine: LLMEngine) -> LoRAAdapters:
    if engine.runner.lora is None:
        raise LoRAError("LoRA adapters need --enable-lora")
    return engine.runner.lora
