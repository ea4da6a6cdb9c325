"""Prefix-cache accounting in tokens, as vLLM counts it, plus the recent hit rate users keep asking vLLM for."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixCacheStats:
    """Totals since start, and a hit rate over the last `window` queries (totals hide what the cache does now). A query
    is one request's first admission, not every lookup (KVCacheManager.record_prefix_query)."""

    window: int = 1000
    queries_total: int = 0
    hits_total: int = 0
    # Looked-up tokens that missed because the pool had evicted their blocks shortly before (its ghost list).
    evicted_misses_total: int = 0
    recent: deque[tuple[int, int]] = field(default_factory=deque)
    recent_queries: int = 0
    recent_hits: int = 0

    def record(self, queries: int, hits: int) -> None:
        self.queries_total += queries
        self.hits_total += hits
        self.recent.append((queries, hits))
        self.recent_queries += queries
        self.recent_hits += hits
        if len(self.recent) > self.window:
            old_q, old_h = self.recent.popleft()
            self.recent_queries -= old_q
            self.recent_hits -= old_h

    @property
    def hit_rate(self) -> float:
        return self.recent_hits / self.recent_queries if self.recent_queries else 0.0
