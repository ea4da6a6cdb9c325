"""Percentiles and summaries: the numbers every latency figure is made of."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvserve.bench.stats import median, percentile, ratio, summarize


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear_interpolation(n, q):
    rng = random.Random(n * 1000 + q)
    samples = [rng.uniform(0, 100) for _ in range(n)]
    assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)))


def test_percentile_known_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20], 90) == pytest.approx(19.0)
    assert median([5, 1, 3]) == 3  # order of the samples does not matter
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_and_ratio():
    s = summarize([float(v) for v in range(1, 101)])
    assert (s.count, s.min, s.max, s.mean) == (100, 1.0, 100.0, 50.5)
    assert s.p50 == pytest.approx(50.5) and s.p90 == pytest.approx(90.1) and s.p99 == pytest.approx(99.01)
    assert set(s.to_json()) == {"count", "mean", "p50", "p90", "p99", "min", "max"}
    assert summarize([]) is None  # absent, never a fake zero
    assert ratio(6.0, 3.0) == 2.0 and ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
