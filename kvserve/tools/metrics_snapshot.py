"""A kvserve /metrics exposition as numbers doctor can reason about, and the windows between two scrapes.

Metric names follow vLLM's with the `kvserve:` prefix; samples are summed over their labels (one engine, one
model). Parsing uses prometheus_client's own parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

P = "kvserve:"
TTFT = f"{P}time_to_first_token_seconds"
ITL = (f"{P}inter_token_latency_seconds", f"{P}time_per_output_token_seconds")  # new name, vLLM's older name
E2E = f"{P}e2e_request_latency_seconds"
PROMPT_LEN = f"{P}request_prompt_tokens"
QUEUE = f"{P}request_queue_time_seconds"  # arrival to first scheduling
PREFILL = f"{P}request_prefill_time_seconds"  # first scheduling to first token


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One scrape: sample name -> value summed over label sets, plus the cache_config_info labels."""

    values: dict[str, float]
    cache_config: dict[str, str] = field(default_factory=dict)
    time: float = 0.0  # when it was taken (seconds, any origin); 0 for files
    # (sample name, label, label value) -> value summed over the other labels: e.g. acceptance per draft position
    by_label: dict[tuple[str, str, str], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, time: float = 0.0) -> Snapshot:
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[str, float] = {}
        by_label: dict[tuple[str, str, str], float] = {}
        config: dict[str, str] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == f"{P}cache_config_info":
                        config = dict(sample.labels)
                    elif "le" not in sample.labels and "quantile" not in sample.labels:
                        values[sample.name] = values.get(sample.name, 0.0) + sample.value
                        for label, label_value in sample.labels.items():
                            key = (sample.name, label, label_value)
                            by_label[key] = by_label.get(key, 0.0) + sample.value
        except ValueError as e:
            raise ValueError(f"not a Prometheus text exposition: {e}") from e
        if not any(name.startswith(P) for name in values) and not config:
            raise ValueError("no kvserve: metrics in this exposition (is it a kvserve server's /metrics?)")
        return cls(values, config, time, by_label)

    def get(self, name: str) -> float | None:
        return self.values.get(name if name.startswith(P) else P + name)

    def by_int_label(self, name: str, label: str) -> dict[int, float]:
        """Label value (an integer, e.g. a position) -> the sample's value, for one sample name."""
        name = name if name.startswith(P) else P + name
        out = {}
        for (sample, key, value), v in self.by_label.items():
            if sample == name and key == label and value.lstrip("-").isdigit():
                out[int(value)] = v
        return out

    def by_str_label(self, name: str, label: str) -> dict[str, float]:
        """Label value -> the sample's value, for one sample name."""
        name = name if name.startswith(P) else P + name
        return {value: v for (sample, key, value), v in self.by_label.items() if sample == name and key == label}

    @property
    def kv_usage(self) -> float | None:
        return self.get("kv_cache_usage_perc")

    @property
    def running(self) -> float | None:
        return self.get("num_requests_running")

    def config_int(self, key: str) -> int | None:
        value = self.cache_config.get(key)
        try:
            return None if value is None else int(float(value))
        except ValueError:
            return None


ZERO = Snapshot({})


@dataclass(frozen=True, slots=True)
class Window:
    """What happened between two scrapes (or since the server started): counts and means of the deltas."""

    requests: float  # first tokens produced (TTFT observations)
    ttft_mean: float | None
    prompt_len_mean: float | None
    itl_mean: float | None
    e2e_mean: float | None
    preemptions: float
    prefix_queries: float
    prefix_hits: float
    kv_usage: float | None  # the gauge at the end of the window
    running: float | None
    waiting: float | None  # the gauge at the end of the window
    queue_mean: float | None  # mean wait for admission (request_queue_time_seconds)
    prefill_mean: float | None  # mean first scheduling -> first token (request_prefill_time_seconds)

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Window:
        def delta(name: str) -> float:
            return (b.values.get(name) or 0.0) - (a.values.get(name) or 0.0)

        def mean(names: tuple[str, ...]) -> float | None:
            count = max((delta(n + "_count") for n in names), default=0.0)
            name = next((n for n in names if delta(n + "_count") == count), names[0])
            return delta(name + "_sum") / count if count > 0 else None

        requests = delta(TTFT + "_count")
        prompt_mean = mean((PROMPT_LEN,))
        if prompt_mean is None and requests > 0 and f"{P}prompt_tokens_total" in b.values:
            prompt_mean = delta(f"{P}prompt_tokens_total") / requests
        return cls(
            requests,
            mean((TTFT,)),
            prompt_mean,
            mean(ITL),
            mean((E2E,)),
            delta(f"{P}num_preemptions_total"),
            delta(f"{P}prefix_cache_queries_total"),
            delta(f"{P}prefix_cache_hits_total"),
            b.kv_usage,
            b.running,
            b.get("num_requests_waiting"),
            mean((QUEUE,)),
            mean((PREFILL,)),
        )

    @property
    def compute_mean(self) -> float | None:
        """Mean time from admission to the first token: the part of TTFT that prompt length drives.

        Why: TTFT = queue time + prefill time, and a queue (too few sequence slots, a full KV cache) raises TTFT
        whatever the prompts are. The prefill histogram when the server has it, else TTFT less queue time,
        else TTFT itself (a server without either histogram)."""
        if self.prefill_mean is not None:
            return self.prefill_mean
        if self.ttft_mean is not None and self.queue_mean is not None:
            return max(self.ttft_mean - self.queue_mean, 0.0)
        return self.ttft_mean


def windows(snapshots: list[Snapshot]) -> list[Window]:
    """Consecutive windows between scrapes; a single scrape gives one window since the server started."""
    if len(snapshots) == 1:
        return [Window.between(ZERO, snapshots[0])]
    return [Window.between(a, b) for a, b in pairwise(snapshots)]
