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
    """One stored response: the Response object (what GET returns), the conversation it ended (the next turn's
    history) and the `cache_salt` it was computed under, which a chained request inherits so that its conversation
    stays in that tenant's part of the cache."""

    response: dict[str, Any]
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

    def get(self, response_id: str, param: str | None = "previous_response_id") -> StoredResponse:
        """The stored response; a 404 naming `param` (the field that gave the id; None: the URL) if there is none."""
        stored = self._items.get(response_id)
        if stored is None:
            raise self._not_found(response_id, param)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        """Forget a response (DELETE /v1/responses/{id}); a 404 if there is none."""
        if self._items.pop(response_id, None) is None:
            raise self._not_found(response_id, None)

    def _not_found(self, response_id: str, param: str | None) -> APIError:
        return APIError(
            404,
            f"{param or 'response'} {response_id!r} not found (responses are kept in this server's memory, the last "
            f"{self.max_size} stored)",
            param=param,
            code="response_not_found",
        )
