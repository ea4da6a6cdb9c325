"""Summary statistics for latency samples: medians for repeated runs, p50/p90/p99 for request latencies."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default), so that
    figures agree with what users compute themselves from the raw samples."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50)


@dataclass(frozen=True, slots=True)
class Summary:
    """The distribution of one latency (in the unit it was given in)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def summarize(samples: Sequence[float]) -> Summary | None:
    """None for no samples (e.g. inter-token latency of one-token outputs): absent, never a fake zero."""
    if not samples:
        return None
    return Summary(
        count=len(samples),
        mean=sum(samples) / len(samples),
        p50=percentile(samples, 50),
        p90=percentile(samples, 90),
        p99=percentile(samples, 99),
        min=min(samples),
        max=max(samples),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """A ratio that is None when either side is missing or the denominator is zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
