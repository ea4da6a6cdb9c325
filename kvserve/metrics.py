"""Prometheus metrics under vLLM's names with a `kvserve:` prefix, so existing dashboards carry over.

Every series carries vLLM's `model_name` label (the first served name), so that vLLM's Grafana dashboard, whose
queries filter on it, works with the prefix changed (docs/CAPACITY.md, "Metrics and dashboards").

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
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.engine.stats import ITERATION_TOKEN_BUCKETS
from kvserve.kv.misses import tenant_counts

if TYPE_CHECKING:
    from kvserve.engine.stats import EngineStats, RequestMetrics
    from kvserve.outputs import RequestOutput
    from kvserve.sampling_params import SamplingParams

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


_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts up to max-model-len)."""
    out: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class EngineStatsCollector:
    """Gauges, counters and the step-size histogram computed from the engine's latest EngineStats at each scrape.
    `operator`: the scrape is the operator's (behind --admin-api-key), so it counts the miss reasons only operators
    may see; otherwise those count as what clients are told (kv/misses.py OPERATOR_ONLY)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, operator: bool = False) -> None:
        self._stats = stats
        self._model = [model_name]
        self._operator = operator

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        model = self._model
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting for admission.", s.num_waiting),
            ("kv_cache_usage_perc", "Share of KV blocks referenced by requests (0..1).", s.kv_cache_usage),
            (
                "prefix_cache_hit_rate",
                "Share of looked-up prompt tokens found in the prefix cache, over the last 1,000 lookups (0..1).",
                s.prefix_cache_hit_rate,
            ),
            ("kv_pinned_prefixes", "Prompt prefixes pinned by cache_control marks, alive now.", s.kv_pinned_prefixes),
            (
                "kv_pinned_blocks",
                "KV blocks the pinned prefixes hold (within --max-pinned-kv-fraction of the pool).",
                s.kv_pinned_blocks,
            ),
            ("state_slots_used", "A hybrid model's state slots held by running requests.", s.state_slots_used),
            (
                "state_snapshots",
                "A hybrid model's state snapshots kept for prefix hits (at block boundaries, docs/MODELS.md).",
                s.state_snapshots,
            ),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits_tokens),
            (
                "prefix_cache_evicted_misses",
                "Prompt tokens that missed the prefix cache because the pool had evicted their blocks shortly before "
                "(kept by an offload tier, --kv-offloading-size).",
                s.prefix_cache_evicted_misses_tokens,
            ),
            ("num_preemptions", "Preemptions (requests evicted to free KV blocks).", s.num_preemptions),
            ("kv_pins_created", "Prompt prefixes pinned by cache_control marks.", s.kv_pins_created),
            ("state_snapshots_saved", "State snapshots saved at block boundaries.", s.state_snapshots_saved),
            (
                "state_snapshots_restored",
                "State snapshots restored into a request's slot (prefix hits of a hybrid model).",
                s.state_snapshots_restored,
            ),
            (
                "state_snapshots_evicted",
                "State snapshots overwritten, least recently used first.",
                s.state_snapshots_evicted,
            ),
            ("kv_pins_expired", "Pinned prefixes released when their TTL ran out.", s.kv_pins_expired),
            (
                "kv_pins_displaced",
                "Pins released before their TTL: to make room under --max-pinned-kv-fraction for newer pins (least "
                "recently used first, of the tenant holding the most), or for a request the pool could not fit "
                "otherwise; their blocks stay ordinary cached blocks.",
                s.kv_pins_displaced,
            ),
            (
                "kv_pins_refused",
                "Pins refused because alone they exceed --max-pinned-kv-fraction (the prefix stays an "
                "ordinary cached prefix).",
                s.kv_pins_refused,
            ),
            (
                "kv_pins_tenant_capped",
                "Pins displaced or refused because their tenant (cache_salt) held its whole "
                "--max-pinned-kv-fraction-per-tenant.",
                s.kv_pins_tenant_capped,
            ),
            (
                "kv_retention_capped",
                "Offload-tier records a prompt_cache_retention asked for past its budgets (half the tier in all, "
                "--max-retained-kv-fraction-per-tenant a tenant): not retained.",
                s.kv_retention_capped,
            ),
            ("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.prompt_tokens_total),
            ("generation_tokens", "Tokens generated.", s.generation_tokens_total),
            ("spec_decode_num_drafts", "Speculative drafts verified.", s.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens", "Drafted tokens verified.", s.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", s.spec_decode_num_accepted_tokens),
        ]
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(model, value)
            yield counter
        if s.prefix_cache_miss_reasons:
            misses = CounterMetricFamily(
                PREFIX + "prefix_cache_miss_reasons",
                "Requests whose prefix hit stopped short of their prompt, by why (docs/PROMPT_CACHING.md): "
                "never_seen, evicted, pin_expired, diverged, outside_sliding_window, no_state_snapshot, "
                "tier_record_failed_check; different_cache_salt only on a server with --admin-api-key (else counted "
                "as never_seen, as clients are told).",
                labels=["model_name", "reason"],
            )
            reasons = s.prefix_cache_miss_reasons if self._operator else tenant_counts(s.prefix_cache_miss_reasons)
            for reason, count in reasons:
                misses.add_metric([*model, reason], count)
            yield misses
        if s.offload is not None:
            yield from _offload_metrics(s, model)
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculation on: one sample per draft position, as vLLM
            per_pos = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this draft position (0-based) was accepted.",
                labels=["model_name", "position"],
            )
            for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*model, str(pos)], value)
            yield per_pos
        if s.iteration_tokens_counts:
            cumulative, buckets = 0, []
            for bound, count in zip((*ITERATION_TOKEN_BUCKETS, float("inf")), s.iteration_tokens_counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
            steps = HistogramMetricFamily(
                PREFIX + "iteration_tokens_total", "Tokens in each engine step.", labels=["model_name"]
            )
            steps.add_metric(model, buckets, sum_value=s.iteration_tokens_sum)
            yield steps


def _offload_metrics(s: EngineStats, model: list[str]) -> Iterator[Metric]:
    """The KV offload tier's series (docs/KV_OFFLOAD.md): vLLM's external prefix cache counters (what a KV connector
    restores), and kvserve's kv_offload_* for the tier itself, labelled with its medium (CPU or DISK)."""
    o = s.offload
    assert o is not None
    labels = ["model_name", "medium"]
    where = [*model, o.medium]
    counters = [
        (
            "external_prefix_cache_queries",
            "Prompt tokens looked up in the KV offload tier (past the pool's prefix hits).",
            s.external_prefix_cache_queries_tokens,
        ),
        (
            "external_prefix_cache_hits",
            "Prompt tokens restored from the KV offload tier.",
            s.external_prefix_cache_hits_tokens,
        ),
        ("kv_offload_stored_blocks", "Blocks this process wrote into the KV offload tier.", o.stored_blocks),
        (
            "kv_offload_dropped_blocks",
            "Blocks not written into the tier: its writer's queue was full, or the tier had failed.",
            o.dropped_blocks,
        ),
        ("kv_offload_restored_blocks", "Blocks restored from the tier instead of recomputed.", o.restored_blocks),
        (
            "kv_offload_restore_failures",
            "Stored records refused on restore (checksum, length, fingerprint or content mismatch, gone): recomputed.",
            o.restore_failures,
        ),
        ("kv_offload_io_errors", "Reads and writes of the tier that failed with an OS error.", o.io_errors),
    ]
    for name, doc, value in counters:
        counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        counter.add_metric(where, value)
        yield counter
    gauges = [
        (
            "kv_offload_bytes",
            "Bytes the KV offload tier holds (on disk: its directory, shared replicas included).",
            o.bytes_used,
        ),
        (
            "kv_offload_capacity_bytes",
            "The KV offload tier's budget in bytes (--kv-offloading-size).",
            o.capacity_bytes,
        ),
        ("kv_offload_blocks", "Blocks the KV offload tier holds.", o.num_blocks),
        (
            "kv_offload_available",
            "1 while the tier stores blocks; 0 once it failed (a full or unwritable disk).",
            float(o.available),
        ),
    ]
    for name, doc, level in gauges:
        gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        gauge.add_metric(where, level)
        yield gauge
    restore = SummaryMetricFamily(
        PREFIX + "kv_offload_restore_seconds", "Time spent restoring blocks from the tier, per restore.", labels=labels
    )
    restore.add_metric(where, count_value=o.restores, sum_value=o.restore_seconds_total)
    yield restore


class GrammarCollector:
    """The grammar compile pool's load at each scrape (kvserve's own series: vLLM has none for it)."""

    def __init__(self, in_flight: Callable[[], int], model_name: str) -> None:
        self._in_flight, self._model = in_flight, [model_name]

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            PREFIX + "grammar_compiles_in_flight",
            "Grammar compiles running or queued (--structured-outputs-config bounds them).",
            labels=["model_name"],
        )
        gauge.add_metric(self._model, self._in_flight())
        yield gauge


class ServerMetrics:
    """All of the server's collectors, in a registry of their own, every series labelled with the model's name."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        cache_config: Mapping[str, object],
        model_name: str,
        max_model_len: int,
        operator: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats, model_name, operator))
        info = Info(PREFIX + "cache_config", "KV cache configuration.", registry=self.registry)
        info.info({k: str(v) for k, v in cache_config.items()})
        self.model_name = model_name
        self._success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        tokens = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)

        families = {
            "ttft": histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS),
            "itl": histogram("inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS),
            "e2e": histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS),
            "queue_time": histogram("request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS),
            "prefill_time": histogram(
                "request_prefill_time_seconds", "First scheduling to first token.", _LATENCY_BUCKETS
            ),
            "decode_time": histogram("request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS),
            "inference_time": histogram(
                "request_inference_time_seconds", "First scheduling to finish (prefill and decode).", _LATENCY_BUCKETS
            ),
            "tpot": histogram(
                "request_time_per_output_token_seconds",
                "Decode time over the output tokens after the first, per request.",
                _ITL_BUCKETS,
            ),
            "prompt_tokens": histogram("request_prompt_tokens", "Prompt tokens of each finished request.", tokens),
            "generation_tokens": histogram(
                "request_generation_tokens", "Tokens generated for each finished request (all of its n).", tokens
            ),
            "params_n": histogram("request_params_n", "The n request parameter.", _PARAMS_N_BUCKETS),
            "params_max_tokens": histogram(
                "request_params_max_tokens", "The max_tokens request parameter, where a request set one.", tokens
            ),
        }
        # The children for this model, observed directly (labels() looks the child up on every call).
        child = {name: family.labels(model_name) for name, family in families.items()}
        self.ttft, self.itl, self.e2e = child["ttft"], child["itl"], child["e2e"]
        self.queue_time, self.prefill_time = child["queue_time"], child["prefill_time"]
        self.decode_time, self.inference_time, self.tpot = child["decode_time"], child["inference_time"], child["tpot"]
        self.prompt_tokens, self.generation_tokens = child["prompt_tokens"], child["generation_tokens"]
        self.params_n, self.params_max_tokens = child["params_n"], child["params_max_tokens"]

    def request_success(self, reason: str) -> Counter:
        """The success counter of one finish reason, for this model."""
        return self._success.labels(self.model_name, reason)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, params: SamplingParams | None = None) -> RequestTracker:
        return RequestTracker(self, params)


class RequestTracker:
    """Follows one request's outputs as the server receives them: inter-token gaps as they arrive,
    latencies and the finish reason once it is done. Aborted requests are not successes."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None) -> None:
        self._metrics = metrics
        self._params = params
        self._last_times: dict[int, float] = {}  # by sample index: when its latest tokens arrived
        self._finish_reasons: list[str] = []
        self._num_generated = 0

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        # The server's outputs are deltas (RequestOutputKind.DELTA): each sample's tokens and finish arrive once.
        new = sum(len(c.token_ids) for c in output.outputs)
        self._num_generated += new
        self._finish_reasons.extend(c.finish_reason for c in output.outputs if c.finish_reason is not None)
        for sample in output.outputs:
            self._observe_gaps(sample.index, len(sample.token_ids), now, output.metrics)
        if output.finished:
            self._finish(output, now)

    def _observe_gaps(self, index: int, new: int, now: float, metrics: RequestMetrics | None) -> None:
        """One sample's inter-token gaps: tokens that arrive together share the time since its previous tokens evenly.
        A sample's first tokens count from the engine's first-token time, so that a reader slower than the engine
        (whose outputs then arrive coalesced) still sees every gap but the first token's."""
        if new == 0:
            return
        previous = self._last_times.get(index)
        if previous is None:
            previous, new = (metrics.first_token_time if metrics is not None else None), new - 1
        if previous is not None and new > 0:
            gap = max(now - previous, 0.0) / new
            for _ in range(new):
                self._metrics.itl.observe(gap)
        self._last_times[index] = now

    def _finish(self, output: RequestOutput, now: float) -> None:
        reasons = self._finish_reasons
        if "abort" in reasons:
            return
        metrics = self._metrics
        for reason in reasons:
            metrics.request_success(reason).inc()
        metrics.prompt_tokens.observe(len(output.prompt_token_ids))
        metrics.generation_tokens.observe(self._num_generated)
        if self._params is not None:
            metrics.params_n.observe(self._params.n)
            if self._params.max_tokens is not None:
                metrics.params_max_tokens.observe(self._params.max_tokens)
        m = output.metrics
        if m is None:
            return
        finished = m.finished_time or now
        if m.first_token_time is not None:
            metrics.ttft.observe(m.first_token_time - m.arrival_time)
            metrics.decode_time.observe(finished - m.first_token_time)
            per_sample = self._num_generated / (self._params.n if self._params is not None else 1)
            if per_sample > 1:
                metrics.tpot.observe((finished - m.first_token_time) / (per_sample - 1))
        if m.first_scheduled_time is not None:
            metrics.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            metrics.inference_time.observe(finished - m.first_scheduled_time)
            if m.first_token_time is not None:  # TTFT = queue + prefill: doctor tells the two causes apart
                metrics.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        metrics.e2e.observe(finished - m.arrival_time)
