"""The server's (and `LLM`'s) start-up objects leave the cyclic collector's view, and come back at
shutdown or at the next freeze, which collects what an earlier one kept and has died since."""

from __future__ import annotations

import gc

from pagedserve.engine.heap import freeze_startup_objects, thaw_startup_objects


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector can free it


def test_freezing_exempts_what_is_alive_and_thawing_returns_it_to_the_collector():
    alive = Node()
    try:
        num_frozen = freeze_startup_objects()
        # Frozen objects that die later leave the count (refcounting still frees them).
        assert 0 < gc.get_freeze_count() <= num_frozen
        assert not any(obj is alive for obj in gc.get_objects())  # the collector skips it
    finally:
        thaw_startup_objects()
    assert gc.get_freeze_count() == 0
    assert any(obj is alive for obj in gc.get_objects())


def test_garbage_left_before_the_freeze_is_collected_not_frozen():
    import weakref

    garbage = Node()
    ref = weakref.ref(garbage)
    del garbage  # unreachable, but a cycle: still alive until a collection
    try:
        freeze_startup_objects()
        assert ref() is None
    finally:
        thaw_startup_objects()


def test_a_later_freeze_collects_what_an_earlier_one_kept_and_has_died():
    import weakref

    dropped = Node()
    ref = weakref.ref(dropped)
    try:
        freeze_startup_objects()  # e.g. one LLM built
        del dropped  # e.g. that LLM dropped: a frozen cycle, which no collection looks at
        gc.collect()
        assert ref() is not None
        freeze_startup_objects()  # the next LLM built
        assert ref() is None
    finally:
        thaw_startup_objects()
