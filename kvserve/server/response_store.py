"""Stored Responses (`store: true`): the conversation each response ended, by id, for `previous_response_id`.

In this process's memory only, bounded (an LRU): what it holds is prompt-derived text, and a restart forgets it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.errors import APIError

MAX_STORED_RESPONSES = 256


@dataclass(slots=True)
class ResponseStore:
    """The conversations of stored responses, by id, most recently used last (bounded)."""

    max_size: int = MAX_STORED_RESPONSES
    _items: OrderedDict[str, list[dict[str, Any]]] = field(default_factory=OrderedDict)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = messages
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        messages = self._items.get(response_id)
        if messages is None:
            raise APIError(
                404,
                f"previous_response_id {response_id!r} not found (responses are kept in this server's memory, the "
                f"last {self.max_size} stored)",
                param="previous_response_id",
                code="response_not_found",
            )
        self._items.move_to_end(response_id)
        return messages
