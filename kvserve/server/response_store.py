"""Stored Responses (`store: true`): what each response ended with, by id, for `previous_response_id` and for
`GET /v1/responses/{id}`.

In this process's memory only, bounded (an LRU): what it holds is prompt-derived text, and a restart forgets it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.errors import APIError

MAX_STORED_RESPONSES = 256


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: the conversation it ended (the next turn's history) and the `cache_salt` it was computed
    under, which a chained request inherits so that its conversation stays in that tenant's part of the cache."""

    conversation: list[dict[str, Any]]
    cache_salt: str | None = None

    def chained_salt(self, given: str | None) -> str | None:
        """The salt of a request chained to this one: its own if it gives one, else this response's."""
        return given if given is not None else self.cache_salt


@dataclass(slots=True)
class ResponseStore:
    """Stored responses, by id, most recently used last (bounded)."""

    max_size: int = MAX_STORED_RESPONSES
    _items: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"previous_response_id {response_id!r} not found (responses are kept in this server's memory, the "
                f"last {self.max_size} stored)",
                param="previous_response_id",
                code="response_not_found",
            )
        self._items.move_to_end(response_id)
        return stored
