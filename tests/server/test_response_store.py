"""The Responses API's store (server/response_store.py) on its own: its byte budget, least
recently used eviction, chains rebuilt oldest first, and a chain broken by a forgotten link."""

from __future__ import annotations

import pytest

from pagedserve.server.response_store import (
    ResponseStore,
    StoredResponse,
    UnknownResponseError,
    encode,
)


def _entry(previous: str | None, text: str, size: int = 100) -> StoredResponse:
    """`size` bytes in all: the response, its messages and its input items count alike."""
    messages = encode([{"role": "assistant", "content": text}])
    items = encode([{"id": "msg_1", "type": "message", "role": "user", "content": []}])
    return StoredResponse(b"x" * (size - len(messages) - len(items)), previous, messages, items)


def test_the_budget_is_bytes_and_the_least_recently_used_go_first():
    store = ResponseStore(250)
    for name in ("a", "b"):
        assert store.put(name, _entry(None, name))
    store.get("a")  # read: now the most recent
    assert store.put("c", _entry(None, "c"))
    assert store.num_bytes == 200 and len(store) == 2
    with pytest.raises(UnknownResponseError):
        store.get("b")
    assert not store.put("huge", _entry(None, "huge", size=251))  # alone over the budget
    assert store.num_bytes == 200  # nothing forgotten for it
    store.delete("a")
    assert store.num_bytes == 100
    with pytest.raises(UnknownResponseError):
        store.delete("a")


def test_a_chain_is_rebuilt_oldest_first_until_a_forgotten_link():
    store = ResponseStore(1000)
    store.put("r1", _entry(None, "one"))
    store.put("r2", _entry("r1", "two"))
    store.put("r3", _entry("r2", "three"))
    assert [m["content"] for m in store.conversation("r3")] == ["one", "two", "three"]
    store.delete("r2")
    with pytest.raises(UnknownResponseError) as error:
        store.conversation("r3")
    assert error.value.response_id == "r2"
    assert not ResponseStore(0).enabled
