"""Stored responses: what the Responses API's `previous_response_id` continues and
GET /v1/responses/{id} (and its /input_items) returns (`store: true`, OpenAI's default).

Each entry keeps its own turn only: the response as answered, the messages its request added
(instructions aside, which OpenAI does not carry over) with its output as chat messages, and its
input as OpenAI lists it, all as compact JSON, with the id of the response it continued. A
conversation is rebuilt by walking that chain back, so a long chain costs its length once, not
its length squared. The store holds at most `--responses-store-memory` bytes of that JSON: past
it, the least recently stored or read entries are forgotten (one response larger than the whole
budget is not stored at all), and a chain that runs into a forgotten one cannot be continued
(404, naming it).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_json: bytes  # the response object as it was answered
    previous_response_id: str | None
    messages_json: bytes  # this turn's input, then its output, as chat messages
    input_items_json: bytes  # the request's input as OpenAI's items (server/input_items.py)

    @property
    def size(self) -> int:
        return len(self.response_json) + len(self.messages_json) + len(self.input_items_json)


class UnknownResponseError(KeyError):
    """No stored response has this id (never stored, deleted, or forgotten)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


def encode(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # handlers run on the event loop; tests may not

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry`, forgetting the least recently used past the budget; False (nothing
        kept, nothing forgotten) if it alone is larger than the budget."""
        if entry.size > self.budget_bytes:
            return False
        with self._lock:
            self._remove(response_id)
            self._entries[response_id] = entry
            self.num_bytes += entry.size
            while self.num_bytes > self.budget_bytes:
                self._remove(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise UnknownResponseError(response_id)
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> None:
        with self._lock:
            if not self._remove(response_id):
                raise UnknownResponseError(response_id)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every message of the chain that ends with `response_id`, oldest first."""
        turns = []
        next_id: str | None = response_id
        while next_id is not None:
            entry = self.get(next_id)
            turns.append(json.loads(entry.messages_json))
            next_id = entry.previous_response_id
        return [message for turn in reversed(turns) for message in turn]

    def _remove(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.size
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
