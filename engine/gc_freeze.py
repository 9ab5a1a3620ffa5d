"""Keep the objects that exist once the engine has started out of the cyclic garbage collector's
full collections (`gc.freeze`), as vLLM's engine does after its start-up: at the end of
`LLM.__init__` and of the server engine's start (`AsyncEngine`), not in `LLMEngine` itself, which
tests build by the hundred (each freeze starts with a full collection, ~0.2 s in such a process).

Start-up leaves ~410,000 objects tracked by the collector (the modules of transformers and torch,
the tokenizer, the model's modules and parameters), and they live as long as the engine. A full
(generation 2) collection walks every one of them, and serving allocates enough long-lived
objects (requests, token lists, outputs) to start one every few seconds: on the fixed workload
(`python -m pagedserve.benchmarks.peers`, bfloat16, 2-core Sapphire Rapids) two full collections
took 0.53-0.72 s of the run, and its time outside the forward pass ("everything else") was
0.89-1.02 s against 0.59-0.63 s with the start-up objects frozen (alternating runs), where the
same two collections took 0.01 s.

A frozen object is never examined by the cycle collector: reference counting still frees whatever
nothing refers to, but a reference cycle among frozen objects that becomes garbage later stays in
memory. So a process that builds and drops engines repeatedly (the test suite) calls
`gc.unfreeze()` after dropping one. The freeze is also undone at interpreter exit, so that exit's
own collection sees everything again: triton's nanobind bindings otherwise report their frozen
objects as leaked.
"""

from __future__ import annotations

import atexit
import gc
import logging

logger = logging.getLogger(__name__)

_unfreeze_registered = False


def freeze_startup_objects() -> int:
    """Collect what start-up left as garbage, then freeze every object still tracked; returns how
    many objects are frozen now."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    frozen = gc.get_freeze_count()
    logger.debug("froze %d start-up objects out of the collector's full collections", frozen)
    return frozen
