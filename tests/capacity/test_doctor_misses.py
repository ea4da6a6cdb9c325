"""doctor's prefix-miss finding (kvserve:prefix_cache_miss_reasons_total, kv/misses.py), from synthetic scrapes."""

from __future__ import annotations

from test_doctor import exposition

from kvserve.tools.doctor_checks import Evidence, Finding, diagnose
from kvserve.tools.metrics_snapshot import Snapshot


def miss_page(**counts: float) -> str:
    text = exposition() + "# TYPE kvserve:prefix_cache_miss_reasons counter\n"
    return text + "".join(
        f'kvserve:prefix_cache_miss_reasons_total{{model_name="m",reason="{r}"}} {n}\n' for r, n in counts.items()
    )


def miss_findings(*pages: str) -> list[Finding]:
    found = diagnose(Evidence([Snapshot.parse(p) for p in pages]))
    return [f for f in found if f.code.startswith("prefix_misses_")]


def test_the_leading_fixable_reason_is_a_finding() -> None:
    (found,) = miss_findings(miss_page(never_seen=40, evicted=50, diverged=10))
    assert found.code == "prefix_misses_evicted" and "50%" in found.summary and "offload" in found.fix
    assert list(found.evidence["miss_reasons"]) == ["evicted", "never_seen", "diverged"]


def test_cold_prefixes_little_traffic_or_a_minor_reason_is_no_finding() -> None:
    assert miss_findings(miss_page(never_seen=500)) == []  # only cold prefixes: nothing to fix
    assert miss_findings(miss_page(evicted=5)) == []  # too few requests to judge
    assert miss_findings(miss_page(never_seen=90, diverged=10)) == []  # 10%: not the story
    assert miss_findings(exposition()) == []  # an older server without the counter


def test_misses_are_judged_over_the_scrapes() -> None:
    early = miss_page(never_seen=100, diverged=0)
    later = miss_page(never_seen=110, diverged=30)
    (found,) = miss_findings(early, later)
    assert found.code == "prefix_misses_diverged" and found.evidence["miss_reasons"] == {
        "diverged": 30,
        "never_seen": 10,
    }
