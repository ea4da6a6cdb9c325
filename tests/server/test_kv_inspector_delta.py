"""The KV inspector's deltas: applied in order to the first snapshot they reproduce every later snapshot exactly
(property test over random workloads on a tiny model), coalesced deltas (skipping snapshots) too, and the order
deltas stay small for a queue-like eviction order."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_workload import random_snapshots

from kvserve.engine.inspector_delta import apply_delta, apply_order, diff_snapshots, order_delta


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), stride=st.integers(1, 3))
def test_deltas_in_order_reproduce_the_latest_snapshot(tiny_model_dir: Path, seed: int, stride: int) -> None:
    snaps = random_snapshots(tiny_model_dir, seed)[::stride]  # stride > 1: coalesced (snapshots skipped)
    state = snaps[0]
    changed = 0
    for prev, snap in zip(snaps, snaps[1:], strict=False):
        delta = diff_snapshots(prev, snap)
        changed += bool(delta)
        state = apply_delta(state, delta)
        assert state == snap
    assert changed  # the workload did change the cache


def test_a_workload_exercises_sharing_eviction_and_requests(tiny_model_dir: Path) -> None:
    """The generator is not vacuous: some seed's snapshots show shared blocks, evictions (order deltas that
    remove cached blocks) and requests coming and going."""
    kinds: set[str] = set()
    for seed in range(6):
        snaps = random_snapshots(tiny_model_dir, seed)
        for prev, snap in zip(snaps, snaps[1:], strict=False):
            delta = diff_snapshots(prev, snap)
            kinds |= set(delta)
            if "s" in snap["block_states"]:
                kinds.add("shared")
            if delta.get("evict_order", {}).get("removed"):
                kinds.add("evicted")
    assert {
        "shared",
        "evicted",
        "blocks",
        "blocks_removed",
        "requests",
        "request_order",
        "prefix_cache",
        "gauges",
    } <= kinds


def test_unchanged_snapshots_give_an_empty_delta(tiny_model_dir: Path) -> None:
    snap = random_snapshots(tiny_model_dir, 1, rounds=5)[-1]
    assert diff_snapshots(snap, snap) == {}
    assert apply_delta(snap, {}) == snap


def test_order_delta_of_a_queue_is_small_and_exact() -> None:
    old = list(range(1000))
    new = [*range(3, 500), *range(501, 1000), 500, 1000, 1001]  # 3 reused from the head, one revived and re-freed
    delta = order_delta(old, new)
    assert delta == {"removed": [0, 1, 2, 500], "appended": [500, 1000, 1001]}
    assert apply_order(old, delta) == new
    assert order_delta(new, new) is None
    odd = [5, 1, 4, 2, 3]
    assert apply_order([1, 2, 3, 4, 5], order_delta([1, 2, 3, 4, 5], odd)) == odd
