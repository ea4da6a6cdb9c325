"""The replica set's own series on /metrics: per-replica load and cache figures (label `replica`) and the
router's decisions (labels `policy`, `reason`). The engine-wide series (kvserve:num_requests_running ...) keep
their single-process names and are the replicas' sum (ClusterEngine.stats), so dashboards carry over."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.metrics import PREFIX

if TYPE_CHECKING:
    from kvserve.cluster.engine import ClusterEngine


class ClusterCollector:
    """Collected at scrape time from the ingress's latest replica reports."""

    def __init__(self, engine: ClusterEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        replicas = self._engine.replicas
        up = GaugeMetricFamily(
            PREFIX + "replica_up", "1 while the replica reports, 0 while it is down.", labels=["replica"]
        )
        gauges = {
            "num_requests_running": ("Requests in the replica's running batch.", lambda s: s.num_running),
            "num_requests_waiting": ("Requests waiting in the replica.", lambda s: s.num_waiting),
            "kv_cache_usage_perc": ("Share of the replica's KV blocks in use (0..1).", lambda s: s.kv_cache_usage),
        }
        counters = {
            "prefix_cache_queries": (
                "Prompt tokens the replica looked up in its prefix cache.",
                lambda s: s.prefix_cache_queries_tokens,
            ),
            "prefix_cache_hits": (
                "Prompt tokens found in the replica's prefix cache.",
                lambda s: s.prefix_cache_hits_tokens,
            ),
            "generation_tokens": ("Tokens the replica generated.", lambda s: s.generation_tokens_total),
        }
        gauge_families = {
            n: GaugeMetricFamily(PREFIX + "replica_" + n, doc, labels=["replica"]) for n, (doc, _) in gauges.items()
        }
        counter_families = {
            n: CounterMetricFamily(PREFIX + "replica_" + n, doc, labels=["replica"]) for n, (doc, _) in counters.items()
        }
        for name, replica in sorted(replicas.items()):
            up.add_metric([name], 1.0 if replica.up else 0.0)
            for n, (_, value) in gauges.items():
                gauge_families[n].add_metric([name], value(replica.stats))
            for n, (_, value) in counters.items():
                counter_families[n].add_metric([name], value(replica.stats))
        yield up
        yield from gauge_families.values()
        yield from counter_families.values()
        decisions = CounterMetricFamily(
            PREFIX + "router_decisions", "Requests routed, by policy and reason.", labels=["policy", "reason"]
        )
        for (policy, reason), count in sorted(self._engine.decisions.items()):
            decisions.add_metric([policy, reason], count)
        yield decisions
