"""Anthropic cache diagnostics' fingerprint store (kvserve/server/cache_diagnostics.py) is kept per tenant: a message is
found only by its own tenant (its cache_salt), and one tenant's many messages never push out another's."""

from __future__ import annotations

from kvserve.server.cache_diagnostics import FingerprintStore, PromptFingerprint, tenant_of


def fingerprint(n: int) -> PromptFingerprint:
    return PromptFingerprint("m", "tools", "system", (f"message {n}",), "settings", prompt_tokens=n)


def test_a_message_is_found_by_its_own_tenant_only():
    store = FingerprintStore(capacity=8)
    a, b, unsalted = tenant_of("tenant-a"), tenant_of("tenant-b"), tenant_of(None)
    store.put(a, "msg_1", fingerprint(1))
    assert store.get(a, "msg_1") == fingerprint(1)
    assert store.get(b, "msg_1") is None and store.get(unsalted, "msg_1") is None  # an id alone finds nothing
    assert store.get(a, None) is None and store.get(a, "msg_2") is None


def test_one_tenants_flood_never_evicts_anothers_messages():
    """Tenant b sends many opted-in messages: the store stays at its capacity, dropping b's oldest, and a's one message
    is still there (the store keyed by message id alone dropped it after `capacity` of b's)."""
    store = FingerprintStore(capacity=8)
    a, b = tenant_of("tenant-a"), tenant_of("tenant-b")
    store.put(a, "msg_a", fingerprint(0))
    for n in range(100):
        store.put(b, f"msg_b{n}", fingerprint(n))
    assert len(store) == 8
    assert store.get(a, "msg_a") == fingerprint(0)
    assert [store.get(b, f"msg_b{n}") is not None for n in (92, 93, 99)] == [False, True, True]  # b keeps its 7 newest
    # A tenant's salt is held as its digest, not its text.
    assert tenant_of("tenant-a") != tenant_of("tenant-b") and b"tenant-a" not in tenant_of("tenant-a")
