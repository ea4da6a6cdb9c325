"""Anthropic's cache diagnostics: `diagnostics.previous_message_id` in a Messages request asks why this request could
not reuse the previous one's cached prefix, answered in the reply's `diagnostics.cache_miss_reason`.

Why fingerprints, not prompts: to say which part changed (model, tools, system, an earlier message) it is enough to
keep one digest per part of each opted-in request, never its text. They live in this process's memory, the last
1,024 opted-in messages, kept per tenant (a `cache_salt`, held as its digest; the unsalted requests are one tenant):
a previous id is looked up among its own tenant's messages only, so another tenant's (known or guessed) id is
`previous_message_not_found` as an unknown or evicted one is, and a tenant that sends many messages evicts its own
oldest first (the tenant holding the most loses one when the store is full), never pushing out the others'.

The reasons, in prompt order (Anthropic renders tools, then system, then messages): `model_changed`,
`tools_changed`, `system_changed`, `messages_changed` (an earlier message differs; appending is no change), and
`unavailable` when those match but another prompt-affecting field (`tool_choice`, `thinking`) differs. No
divergence: `diagnostics` is null. `cache_missed_input_tokens` is the previous prompt's tokens this request did not
read from the cache.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.hashing import salt_key


def digest(value: Any) -> str:
    """A stable digest of a JSON value (keys sorted), so that equal parts compare equal whatever the key order."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class PromptFingerprint:
    """What decides a Messages request's prompt, part by part, as digests."""

    model: str
    tools: str
    system: str
    messages: tuple[str, ...]
    settings: str  # tool_choice and thinking
    prompt_tokens: int = 0

    @classmethod
    def of(cls, body: Any, model: str, prompt_tokens: int = 0) -> PromptFingerprint:
        return cls(
            model,
            digest(body.tools or []),
            digest(body.system or ""),
            tuple(digest(m) for m in body.messages),
            digest([body.tool_choice, body.thinking]),
            prompt_tokens,
        )


def cache_miss_reason(
    previous: PromptFingerprint | None, current: PromptFingerprint, cache_read_tokens: int
) -> dict[str, Any] | None:
    """Why `current` could not reuse `previous`'s prefix (Anthropic's CacheMissReason), or None: no divergence."""
    if previous is None:
        return {"type": "previous_message_not_found"}
    missed = max(previous.prompt_tokens - cache_read_tokens, 0)
    for kind, changed in (
        ("model_changed", previous.model != current.model),
        ("tools_changed", previous.tools != current.tools),
        ("system_changed", previous.system != current.system),
        ("messages_changed", current.messages[: len(previous.messages)] != previous.messages),
    ):
        if changed:
            return {"type": kind, "cache_missed_input_tokens": missed}
    if previous.settings != current.settings:
        return {"type": "unavailable"}
    return None


Tenant = bytes  # a cache_salt's digest (kv/hashing.py salt_key; b"" for the unsalted requests)


def tenant_of(cache_salt: str | None) -> Tenant:
    return salt_key(cache_salt)


@dataclass(slots=True)
class FingerprintStore:
    """The fingerprints of the last `capacity` opted-in messages, by tenant and message id (used on the event loop
    only). A full store drops the least recently used message of the tenant that holds the most."""

    capacity: int = 1024
    _tenants: dict[Tenant, OrderedDict[str, PromptFingerprint]] = field(default_factory=dict)
    _size: int = 0

    def get(self, tenant: Tenant, message_id: str | None) -> PromptFingerprint | None:
        own = self._tenants.get(tenant)
        if message_id is None or own is None:
            return None
        found = own.get(message_id)
        if found is not None:
            own.move_to_end(message_id)
        return found

    def put(self, tenant: Tenant, message_id: str, fingerprint: PromptFingerprint) -> None:
        own = self._tenants.setdefault(tenant, OrderedDict())
        self._size += message_id not in own
        own[message_id] = fingerprint
        own.move_to_end(message_id)
        while self._size > self.capacity:
            largest_key = max(self._tenants, key=lambda t: len(self._tenants[t]))
            largest = self._tenants[largest_key]
            largest.popitem(last=False)
            self._size -= 1
            if not largest:
                del self._tenants[largest_key]

    def __len__(self) -> int:
        return self._size
