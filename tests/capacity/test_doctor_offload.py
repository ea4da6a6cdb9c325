"""doctor's KV offload findings from synthetic /metrics scrapes: prefix hits lost to the pool's evictions (no tier:
add one; a full tier: enlarge it) and restores slower than recomputing."""

from __future__ import annotations

from test_doctor import exposition

from kvserve.tools.doctor_checks import Evidence, diagnose
from kvserve.tools.metrics_snapshot import Snapshot
from kvserve.units import GiB


def page(
    evicted_misses: float = 0, tier: dict[str, float] | None = None, queries: float = 20000, prefill_sum: float = 5.0
) -> str:
    text = exposition(queries=queries, hits=2000, prefill_sum=prefill_sum)
    name = "kvserve:prefix_cache_evicted_misses"
    text += f"# TYPE {name} counter\n{name}_total {evicted_misses}\n"
    if tier is not None:
        for name, value in tier.items():
            kind = "counter" if name.endswith("_total") else "gauge"
            base = name.removesuffix("_total")
            text += f'# TYPE kvserve:{base} {kind}\nkvserve:{name}{{medium="DISK"}} {value}\n'
        text += (
            "# TYPE kvserve:kv_offload_restore_seconds summary\n"
            f'kvserve:kv_offload_restore_seconds_count{{medium="DISK"}} {tier.get("restores", 10)}\n'
            f'kvserve:kv_offload_restore_seconds_sum{{medium="DISK"}} {tier.get("restore_s", 0.01)}\n'
        )
    return text


def codes(text: str) -> list[str]:
    return [f.code for f in diagnose(Evidence([Snapshot.parse(text)]))]


def test_hits_lost_to_eviction_without_a_tier_suggest_one() -> None:
    (finding,) = [f for f in diagnose(Evidence([Snapshot.parse(page(evicted_misses=6000))])) if "evict" in f.code]
    assert finding.code == "prefix_hits_lost_to_eviction"
    assert finding.evidence["evicted_miss_share"] == 0.3
    assert "--kv-offloading-size" in finding.fix


def test_few_hits_lost_to_eviction_are_no_finding() -> None:
    assert "prefix_hits_lost_to_eviction" not in codes(page(evicted_misses=500))
    assert "prefix_hits_lost_to_eviction" not in codes(page(evicted_misses=500, queries=600))


def test_a_full_tier_still_losing_hits_is_too_small() -> None:
    full = {"kv_offload_capacity_bytes": GiB, "kv_offload_bytes": 0.95 * GiB, "kv_offload_restored_blocks_total": 5}
    assert "offload_tier_too_small" in codes(page(evicted_misses=6000, tier=full))
    roomy = dict(full, kv_offload_bytes=0.2 * GiB)
    assert not {"offload_tier_too_small", "prefix_hits_lost_to_eviction"} & set(
        codes(page(evicted_misses=6000, tier=roomy))
    )


def test_restores_slower_than_recomputing_are_a_finding() -> None:
    # 5 s of prefill over 50,000 computed tokens: 0.1 ms a token, 1.6 ms a 16-token block; restores take 10 ms each.
    slow = {"kv_offload_capacity_bytes": GiB, "kv_offload_bytes": 0.1 * GiB, "kv_offload_restored_blocks_total": 100}
    (finding,) = [
        f for f in diagnose(Evidence([Snapshot.parse(page(tier={**slow, "restore_s": 1.0}))])) if "offload" in f.code
    ]
    assert finding.code == "offload_restores_slow"
    assert finding.evidence == {"restore_ms_per_block": 10.0, "recompute_ms_per_block": 1.6}
    assert "offload_restores_slow" not in codes(page(tier={**slow, "restore_s": 0.01}))
