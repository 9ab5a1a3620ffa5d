"""Keep Python's cyclic garbage collector off the objects that live as long as the server.

A loaded engine is ~400,000 tracked objects (the model's modules and parameters, the tokenizer,
every imported module) that are never garbage. A full (generation 2) collection walks all of them
while holding the GIL: ~150 ms on a 2-core Xeon, and the engine thread, which needs the GIL
between its torch ops, stalls a whole step. Anything that allocates many containers makes those
collections more frequent; a 2 Hz `GET /v1/engine/state` poller made them several times more so
and slowed steps by 2-4% (benchmarks/engine_state.py). `gc.freeze()` moves everything alive at
start-up into a permanent generation the collector skips; what is allocated later is collected as
usual. `thaw` gives them back at shutdown, so a process that starts engines one after another
(tests, notebooks) still frees an engine it dropped.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left behind, then exempt everything still alive. Returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_startup_objects() -> None:
    gc.unfreeze()
