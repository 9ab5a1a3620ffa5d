"""Start-up objects frozen out of the garbage collector's full collections (engine/gc_freeze.py):
start-up's garbage is collected first, everything alive then is frozen, objects made later are
collected as before, and `LLM` and the server's engine (`AsyncEngine.start`) freeze once built.
tests/conftest.py unfreezes after every test."""

from __future__ import annotations

import asyncio
import gc
import weakref

from pagedserve.configs import EngineConfig
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.gc_freeze import freeze_startup_objects
from pagedserve.engine.llm import LLM
from tests.engine.conftest import make_engine, make_tiny_model


class Cycle:
    """An object only the cycle collector can free: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


def collector_sees(obj: object) -> bool:
    """Whether `obj` is in one of the collector's generations (frozen objects are in none)."""
    return any(tracked is obj for tracked in gc.get_objects())


def test_freeze_collects_startup_garbage_then_freezes_what_is_alive():
    gc.unfreeze()
    garbage = Cycle()
    garbage_ref = weakref.ref(garbage)
    del garbage
    alive = Cycle()
    frozen = freeze_startup_objects()
    assert garbage_ref() is None  # collected, not frozen
    assert frozen == gc.get_freeze_count() > 0
    assert not collector_sees(alive)
    later = Cycle()  # made after the freeze: collected as before
    assert collector_sees(later)
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None
    gc.unfreeze()
    assert collector_sees(alive)


def test_llm_freezes_its_engine_once_built(default_model_path):
    gc.unfreeze()
    llm = LLM(model=str(default_model_path), num_kv_blocks=16, dtype="float32", device="cpu")
    assert gc.get_freeze_count() > 0
    assert not collector_sees(llm.engine.scheduler) and not collector_sees(llm.engine.runner)


def test_the_server_engine_freezes_once_started(default_tokenizer):
    gc.unfreeze()
    async_engine = AsyncEngine(EngineConfig())
    async_engine.engine = make_engine(make_tiny_model("llama-gqa", default_tokenizer), block_size=4)
    assert collector_sees(async_engine.engine.scheduler)

    async def start_and_stop() -> None:
        await async_engine.start()
        await async_engine.shutdown()

    asyncio.run(start_and_stop())
    assert not collector_sees(async_engine.engine.scheduler)
