"""doctor's low-acceptance finding for speculative decoding, from synthetic /metrics scrapes."""

from __future__ import annotations

from test_doctor import exposition

from kvserve.tools.doctor_checks import Evidence, Finding, Thresholds, diagnose
from kvserve.tools.metrics_snapshot import Snapshot


def spec_page(drafts: float, drafted: float, per_pos: list[float]) -> str:
    """A healthy server's page plus the speculative-decoding counters (accepted = the per-position sum)."""
    text = exposition()
    for name, value in (("drafts", drafts), ("draft_tokens", drafted), ("accepted_tokens", sum(per_pos))):
        text += f"# TYPE kvserve:spec_decode_num_{name} counter\nkvserve:spec_decode_num_{name}_total {value}\n"
    text += "# TYPE kvserve:spec_decode_num_accepted_tokens_per_pos counter\n"
    text += "".join(
        f'kvserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}\n' for i, v in enumerate(per_pos)
    )
    return text


def spec_findings(*pages: str) -> list[Finding]:
    return [f for f in diagnose(Evidence([Snapshot.parse(p) for p in pages])) if f.code == "low_spec_acceptance"]


def test_low_acceptance_is_a_finding_with_acceptance_by_position() -> None:
    # 250 drafts of 4 tokens: 150 kept the first token, 50 the second, 10 the third, none the fourth (21% accepted)
    found = spec_findings(spec_page(250, 1000, [150, 50, 10, 0]))
    assert len(found) == 1
    f = found[0]
    assert f.evidence["acceptance_rate"] == 0.21 and f.evidence["draft_tokens"] == 1000
    assert f.evidence["acceptance_by_position"] == [0.6, 0.2, 0.04, 0.0]
    assert "21.0%" in f.summary and f"{100 * Thresholds().low_spec_acceptance:.0f}%" in f.summary
    assert "num_speculative_tokens" in f.fix and "prompt_lookup_min" in f.fix and "open-ended" in f.fix


def test_good_acceptance_little_traffic_or_speculation_off_is_no_finding() -> None:
    assert spec_findings(spec_page(250, 1000, [240, 200, 150, 100])) == []  # 69% accepted
    assert spec_findings(spec_page(20, 80, [2, 0, 0, 0])) == []  # too few drafted tokens to judge
    assert spec_findings(exposition()) == []  # no speculative counters at all: speculation is off
    assert spec_findings(spec_page(0, 0, [0, 0, 0, 0])) == []  # on, but nothing drafted yet


def test_acceptance_is_judged_over_the_scrapes_not_since_start() -> None:
    early = spec_page(250, 1000, [240, 200, 150, 100])  # a good start...
    later = spec_page(500, 2000, [290, 220, 155, 100])  # ...then 250 drafts keeping 75 of 1000 tokens
    found = spec_findings(early, later)
    assert len(found) == 1 and found[0].evidence["acceptance_rate"] == 0.075
    assert found[0].evidence["acceptance_by_position"] == [0.2, 0.08, 0.02, 0.0]
    assert spec_findings(later) == []  # since start: 765 of 2000, 38%
