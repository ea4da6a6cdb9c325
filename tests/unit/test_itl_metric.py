"""Inter-token latency counts every gap but each sample's first token's, however the server's reads coalesce."""

from __future__ import annotations

from kvserve.engine.stats import EngineStats, RequestMetrics
from kvserve.metrics import ServerMetrics
from kvserve.outputs import CompletionOutput, RequestOutput


def _output(tokens_by_sample: dict[int, int], first_token_time: float, finished: bool) -> RequestOutput:
    samples = [CompletionOutput(i, "", [7] * k, None, None) for i, k in tokens_by_sample.items()]
    metrics = RequestMetrics(0.0, 0.0, first_token_time, None, 0)
    return RequestOutput("r", None, [1, 2], None, samples, finished, metrics=metrics)


def _itl_count(metrics: ServerMetrics) -> float:
    value = metrics.registry.get_sample_value("kvserve:inter_token_latency_seconds_count", {"model_name": "m"})
    return 0.0 if value is None else value


def _server_metrics() -> ServerMetrics:
    idle = EngineStats(0, 0, 16, 16, 4, 0.0, 0, 0, 0.0, 0, 0, 0)
    return ServerMetrics(lambda: idle, {}, "m", 64)


def test_coalesced_first_output_counts_its_gaps() -> None:
    """A reader slower than the engine gets all five tokens in one output: four gaps, not none."""
    metrics = _server_metrics()
    tracker = metrics.tracker()
    tracker.observe(_output({0: 5}, first_token_time=0.0, finished=False))
    assert _itl_count(metrics) == 4
    tracker.observe(_output({0: 2}, first_token_time=0.0, finished=False))
    assert _itl_count(metrics) == 6


def test_samples_count_apart() -> None:
    """n=2 with one token each per output: a gap per sample per later output, none for the first tokens."""
    metrics = _server_metrics()
    tracker = metrics.tracker()
    tracker.observe(_output({0: 1, 1: 1}, first_token_time=0.0, finished=False))
    assert _itl_count(metrics) == 0
    tracker.observe(_output({0: 1, 1: 1}, first_token_time=0.0, finished=False))
    tracker.observe(_output({1: 1}, first_token_time=0.0, finished=False))
    assert _itl_count(metrics) == 3
