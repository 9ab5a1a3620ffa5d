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

The offline `LLM` freezes too, at the end of its construction: in the fixed benchmark workload
(`benchmarks/peers.py`, bfloat16, 2-core Sapphire Rapids) a run made two full collections, 0.53-0.72
s, and its time outside the forward pass was 0.89-1.02 s against 0.59-0.63 s frozen (alternating
runs). It has no shutdown to thaw at: each freeze thaws what an earlier one froze before it
collects, so building an `LLM` frees one dropped before it, and a caller that needs a dropped one's
memory back sooner calls `thaw_startup_objects()` then `gc.collect()` (the benchmarks do).
"""

from __future__ import annotations

import atexit
import functools
import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left behind (and whatever an earlier freeze kept that has died since),
    then exempt everything still alive. Returns how many."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _thaw_at_exit()
    return gc.get_freeze_count()


def thaw_startup_objects() -> None:
    gc.unfreeze()


@functools.cache
def _thaw_at_exit() -> None:
    """Once per process: thaw before the interpreter's last collection, which skips frozen
    objects (triton's bindings otherwise report theirs as leaked when an `LLM` program exits)."""
    atexit.register(thaw_startup_objects)
