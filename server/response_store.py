"""Stored responses: what the Responses API's `previous_response_id` continues and
GET /v1/responses/{id} returns (`store: true`, OpenAI's default).

Each entry keeps its own turn only: the messages its request added (instructions aside, which
OpenAI does not carry over) and its output as chat messages, with the id of the response it
continued. A conversation is rebuilt by walking that chain back, so a long chain costs its length
once, not its length squared. The store is bounded (`--responses-store-size`): past that, the
least recently stored or read entries are forgotten, and a chain that runs into a forgotten one
cannot be continued (404, naming it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    previous_response_id: str | None
    messages: tuple[dict[str, Any], ...]  # this turn's input, then its output, as chat messages


class UnknownResponseError(KeyError):
    """No stored response has this id (never stored, deleted, or forgotten)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # handlers run on the event loop; tests may not

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise UnknownResponseError(response_id)
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._entries.pop(response_id, None) is None:
                raise UnknownResponseError(response_id)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every message of the chain that ends with `response_id`, oldest first."""
        turns = []
        next_id: str | None = response_id
        while next_id is not None:
            entry = self.get(next_id)
            turns.append(entry.messages)
            next_id = entry.previous_response_id
        return [message for turn in reversed(turns) for message in turn]

    def __len__(self) -> int:
        return len(self._entries)
