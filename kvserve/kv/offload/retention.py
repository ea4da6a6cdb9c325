"""Budgets for prompt_cache_retention: how much of the offload tier retained records may hold, in all and per tenant.

Why: a retained record outlives eviction until its time is up (a disk tier passes it over, kv/offload/stores.py). With
no budget, six 24-hour retentions of one tenant marked 980 of a tier's 1,092 records for a day and pushed out another
tenant's retained prefix (a write that finds only retained records evicts the soonest to expire). So retained records
may hold at most `total` records (default half the tier: there is always room for ordinary write-through), and one
tenant (a cache salt; requests without one are one tenant) at most `per_tenant`. A retention past either budget keeps
the prompt's first blocks that fit (a prefix hit needs those first) and counts the rest as `capped`; it never shortens
another tenant's retention.

The count is this process's: what an earlier process retained in a shared directory is not known here (its records
still expire at their times).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.kv.offload.interface import TierKey

if TYPE_CHECKING:
    from kvserve.kv.offload.tier import OffloadTier

# The share of a tier that retained records may hold in all: the rest is always free for write-through.
RETAINED_SHARE = 0.5


@dataclass(slots=True)
class RetentionBudget:
    """Retained tier records by tenant, with their expiry; `total` and `per_tenant` in records."""

    total: int
    per_tenant: int
    retained: dict[TierKey, tuple[bytes, float]] = field(default_factory=dict)  # key -> (tenant, until)
    by_tenant: dict[bytes, int] = field(default_factory=dict)
    expiry: list[tuple[float, TierKey]] = field(default_factory=list)  # a heap; stale entries skipped
    capped: int = 0  # records a retention asked for beyond a budget

    def admit(self, tenant: bytes, keys: Sequence[TierKey], until: float, now: float) -> list[TierKey]:
        """The first of `keys` (in prompt order) that `tenant` may retain until `until`: those it retains already
        (extended), then new ones while both budgets have room."""
        self._expire(now)
        admitted: list[TierKey] = []
        for key in keys:
            held = self.retained.get(key)
            if held is not None and held[0] == tenant:
                self.retained[key] = (tenant, max(held[1], until))
            elif (
                held is not None
                or len(self.retained) >= self.total
                or self.by_tenant.get(tenant, 0) >= (self.per_tenant)
            ):
                self.capped += len(keys) - len(admitted)
                break
            else:
                self.retained[key] = (tenant, until)
                self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
            heapq.heappush(self.expiry, (self.retained[key][1], key))
            admitted.append(key)
        return admitted

    def _expire(self, now: float) -> None:
        while self.expiry and self.expiry[0][0] <= now:
            at, key = heapq.heappop(self.expiry)
            held = self.retained.get(key)
            if held is not None and held[1] <= now:
                del self.retained[key]
                left = self.by_tenant[held[0]] - 1
                if left:
                    self.by_tenant[held[0]] = left
                else:
                    del self.by_tenant[held[0]]


def retention_budget(tier: OffloadTier, per_tenant_share: float) -> RetentionBudget:
    """The budgets of one tier: RETAINED_SHARE of its records in all, `per_tenant_share` of them a tenant."""
    records = tier.config.size_bytes // tier.layout.block_bytes
    return RetentionBudget(int(records * RETAINED_SHARE), int(records * min(per_tenant_share, RETAINED_SHARE)))
