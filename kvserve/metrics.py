"""Prometheus metrics under vLLM's names with a `kvserve:` prefix, so existing dashboards carry over.

Why a per-instance CollectorRegistry: the global registry would make two apps in one process (tests, or an
embedding program) share and clash over counters. Engine-wide figures (queue sizes, KV usage, cumulative
token counts) are read from the engine's stats snapshot at scrape time by a custom collector, so they can
never drift from the engine; per-request latencies are observed by the server as requests finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from kvserve.engine.stats import EngineStats
    from kvserve.outputs import RequestOutput

PREFIX = "kvserve:"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)


class EngineStatsCollector:
    """Gauges and counters computed from the engine's latest EngineStats at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting for admission.", s.num_waiting),
            ("kv_cache_usage_perc", "Share of KV blocks referenced by requests (0..1).", s.kv_cache_usage),
            (
                "prefix_cache_hit_rate",
                "Share of looked-up prompt tokens found in the prefix cache, over the last 1,000 lookups (0..1).",
                s.prefix_cache_hit_rate,
            ),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits_tokens),
            ("num_preemptions", "Preemptions (requests evicted to free KV blocks).", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.prompt_tokens_total),
            ("generation_tokens", "Tokens generated.", s.generation_tokens_total),
            ("spec_decode_num_drafts", "Speculative drafts verified.", s.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens", "Drafted tokens verified.", s.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", s.spec_decode_num_accepted_tokens),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculation on: one sample per draft position, as vLLM
            per_pos = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this draft position (0-based) was accepted.",
                labels=["position"],
            )
            for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([str(pos)], value)
            yield per_pos


class ServerMetrics:
    """All of the server's collectors, in a registry of their own."""

    def __init__(self, stats: Callable[[], EngineStats], cache_config: Mapping[str, object]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats))
        info = Info(PREFIX + "cache_config", "KV cache configuration.", registry=self.registry)
        info.info({k: str(v) for k, v in cache_config.items()})
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduling.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill_time = Histogram(
            PREFIX + "request_prefill_time_seconds",
            "First scheduling to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Follows one request's outputs as the server receives them: inter-token gaps as they arrive,
    latencies and the finish reason once it is done. Aborted requests are not successes."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last_time: float | None = None
        self._finish_reasons: list[str] = []

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        # The server's outputs are deltas (RequestOutputKind.DELTA): each sample's tokens and finish arrive once.
        new = sum(len(c.token_ids) for c in output.outputs)
        self._finish_reasons.extend(c.finish_reason for c in output.outputs if c.finish_reason is not None)
        if new > 0 and self._last_time is not None:
            gap = (now - self._last_time) / new  # outputs that arrive together share the gap evenly
            for _ in range(new):
                self._metrics.itl.observe(gap)
        if new > 0:
            self._last_time = now
        if output.finished:
            self._finish(output, now)

    def _finish(self, output: RequestOutput, now: float) -> None:
        reasons = self._finish_reasons
        if "abort" in reasons:
            return
        for reason in reasons:
            self._metrics.request_success.labels(finished_reason=reason).inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self._metrics.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self._metrics.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:  # TTFT = queue + prefill: doctor tells the two causes apart
                self._metrics.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self._metrics.e2e.observe((m.finished_time or now) - m.arrival_time)
