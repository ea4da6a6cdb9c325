"""doctor on the two loaded servers it misdiagnosed (issue 14), from synthetic /metrics scrapes:
(a) a queue behind --max-num-seqs while the KV cache is nearly empty was called healthy;
(b) random-length prompts under KV pressure were blamed on conversations growing without bound."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from test_doctor import exposition

from kvserve.cli import main
from kvserve.tools.doctor_checks import Evidence, Finding, diagnose
from kvserve.tools.metrics_snapshot import Snapshot


@dataclass(frozen=True)
class Step:
    """What happened in one window between two scrapes, and the gauges at its end."""

    requests: float
    prompt_mean: float
    ttft_mean: float
    queue_mean: float | None = None
    prefill_mean: float | None = None
    usage: float = 0.2
    running: float = 8
    waiting: float = 0
    preemptions: float = 0


def scrapes(steps: list[Step]) -> list[str]:
    """Cumulative /metrics pages: one at the start (everything 0 so far) and one after each step."""
    totals = dict(requests=0.0, prompt_tokens=0.0, ttft_sum=0.0, queue_sum=0.0, prefill_sum=0.0, preemptions=0.0)
    first = steps[0]
    pages = [page(totals, first, first.usage, first.running, first.waiting)]
    for s in steps:
        totals["requests"] += s.requests
        totals["prompt_tokens"] += s.requests * s.prompt_mean
        totals["ttft_sum"] += s.requests * s.ttft_mean
        totals["queue_sum"] += s.requests * (s.queue_mean or 0.0)
        totals["prefill_sum"] += s.requests * (s.prefill_mean or 0.0)
        totals["preemptions"] += s.preemptions
        pages.append(page(totals, s, s.usage, s.running, s.waiting))
    return pages


def page(totals: dict[str, float], step: Step, usage: float, running: float, waiting: float) -> str:
    return exposition(
        usage=usage,
        running=running,
        waiting=waiting,
        preemptions=totals["preemptions"],
        requests=totals["requests"],
        ttft_sum=totals["ttft_sum"],
        prompt_tokens=totals["prompt_tokens"],
        itl_count=1000 + 30 * totals["requests"],
        itl_sum=0.02 * (1000 + 30 * totals["requests"]),
        queries=0,
        hits=0,
        queue_sum=None if step.queue_mean is None else totals["queue_sum"],
        prefill_sum=None if step.prefill_mean is None else totals["prefill_sum"],
    )


def findings(steps: list[Step]) -> list[Finding]:
    return diagnose(Evidence([Snapshot.parse(p) for p in scrapes(steps)]))


def codes(steps: list[Step]) -> list[str]:
    return [f.code for f in findings(steps)]


# (a) --max-num-seqs 2, 8 concurrent clients: 6 wait, 0.4% of the KV cache used, TTFT 9.3 s of which ~9 s queue
QUEUED = Step(
    requests=8, prompt_mean=70, ttft_mean=9.3, queue_mean=9.0, prefill_mean=0.3, usage=0.004, running=2, waiting=6
)


def test_queue_behind_max_num_seqs_is_a_finding() -> None:
    found = findings([QUEUED, QUEUED])
    assert [f.code for f in found] == ["requests_queued"]
    f = found[0]
    assert f.evidence["limited_by"] == "max_num_seqs"
    assert f.evidence["queue_time_mean_s"] == 9.0 and f.evidence["queue_time_source"] == "request_queue_time_seconds"
    assert f.evidence["num_requests_waiting_max"] == 6 and f.evidence["num_requests_running_max"] == 2
    assert f.evidence["requests_that_fit_estimate"] == 450  # 2 requests use 0.4%: 450 would fill 90%
    assert "KV cache has room" in f.summary and "9.0 s" in f.summary
    assert "--max-num-seqs" in f.fix and "replicas" in f.fix


def test_queue_without_the_queue_histogram_falls_back_to_ttft() -> None:
    step = Step(requests=8, prompt_mean=70, ttft_mean=9.3, usage=0.004, running=2, waiting=6)  # an older server
    found = findings([step, step])
    assert [f.code for f in found] == ["requests_queued"]
    assert found[0].evidence["queue_time_source"].startswith("time_to_first_token_seconds")


def test_short_waits_and_no_waits_stay_healthy() -> None:
    busy_but_fine = Step(
        requests=8, prompt_mean=70, ttft_mean=0.4, queue_mean=0.2, prefill_mean=0.2, usage=0.3, running=8, waiting=2
    )  # a burst queued for 200 ms
    assert codes([busy_but_fine] * 3) == []
    no_histogram = Step(requests=8, prompt_mean=70, ttft_mean=3.0, usage=0.3, running=8)  # slow, but nobody waits
    assert codes([no_histogram] * 2) == []


def test_queue_behind_a_full_kv_cache_names_memory() -> None:
    full = Step(
        requests=8, prompt_mean=2000, ttft_mean=5.5, queue_mean=5.0, prefill_mean=0.5, usage=0.95, running=6, waiting=10
    )  # blocks run out before admission: requests wait, none is preempted
    found = findings([full, full])
    assert [f.code for f in found] == ["requests_queued"]
    assert found[0].evidence["limited_by"] == "kv_cache" and "--kv-cache-dtype fp8" in found[0].fix
    # with preemptions, kv_cache_pressure already names the cause and the fix: one finding, not two
    assert codes([full, Step(**{**full.__dict__, "preemptions": 5})]) == ["kv_cache_pressure"]


def test_cli_never_calls_a_queueing_server_healthy(tmp_path: Path, capsys) -> None:
    files = []
    for i, text in enumerate(scrapes([QUEUED, QUEUED])):
        files += ["--metrics-file", str(tmp_path / f"{i}.txt")]
        (tmp_path / f"{i}.txt").write_text(text)
    assert main(["doctor", *files]) == 1
    out = capsys.readouterr().out
    assert "Healthy" not in out and "[requests_queued]" in out
    assert main(["doctor", *files, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["healthy"] and doc["summary"]["queue_time_mean_s"] == 9.0
    assert doc["windows"][0]["queue_mean"] == 9.0 and doc["windows"][0]["prefill_mean"] == 0.3


# (b) random-length prompts (not growing), KV pressure and preemption, TTFT up from queueing


def pressure(prompt_mean: float, ttft: float, queue: float | None, prefill: float | None) -> Step:
    return Step(
        requests=20,
        prompt_mean=prompt_mean,
        ttft_mean=ttft,
        queue_mean=queue,
        prefill_mean=prefill,
        usage=0.97,
        running=12,
        waiting=8,
        preemptions=6,
    )


def test_two_windows_of_random_prompts_are_not_a_trend() -> None:
    # the run: prompt mean 68 -> 128 by chance, TTFT up from queueing
    steps = [pressure(68, 1.0, 0.8, 0.2), pressure(128, 3.1, 2.8, 0.3)]
    assert codes(steps) == ["kv_cache_pressure"]
    # the same on a server without the queue and prefill histograms (only TTFT): still not a trend
    assert codes([pressure(68, 1.0, None, None), pressure(128, 3.1, None, None)]) == ["kv_cache_pressure"]


def test_fluctuating_prompts_over_many_windows_are_not_a_trend() -> None:
    steps = [pressure(p, t, None, None) for p, t in [(68, 1.0), (128, 2.0), (90, 2.5), (140, 3.0), (75, 3.5)]]
    assert codes(steps) == ["kv_cache_pressure"]


def test_rising_prompts_with_ttft_rising_from_the_queue_only_are_not_blamed() -> None:
    # prompts do rise window after window, but the prefill part of TTFT stays flat: the queue made TTFT grow
    steps = [pressure(p, q + 0.2, q, 0.2) for p, q in [(100, 0.5), (140, 1.0), (190, 2.0), (260, 4.0)]]
    assert codes(steps) == ["kv_cache_pressure"]
    # without a prefill histogram, TTFT less queue time is the prefill part
    steps = [pressure(p, q + 0.2, q, None) for p, q in [(100, 0.5), (140, 1.0), (190, 2.0), (260, 4.0)]]
    assert codes(steps) == ["kv_cache_pressure"]


def test_a_sustained_rise_with_prefill_time_is_still_growing_prompts() -> None:
    steps = [
        pressure(p, q + c, q, c) for p, q, c in [(500, 0.5, 0.1), (700, 0.5, 0.15), (1000, 0.6, 0.2), (1500, 0.6, 0.3)]
    ]
    found = findings(steps)
    assert [f.code for f in found] == ["growing_prompts", "kv_cache_pressure"]
    assert found[0].evidence["prefill_mean_s_by_window"] == [0.1, 0.15, 0.2, 0.3]
    assert found[0].evidence["queue_time_mean_s_by_window"] == [0.5, 0.5, 0.6, 0.6]
    assert "4 windows" in found[0].summary
    # three windows of the same rise are not enough to call it a trend
    assert [f.code for f in findings(steps[1:])] == ["kv_cache_pressure"]


# (c) the same queue on a busy, shared host: requests run so slowly that few (or none) end between the scrapes, so the
# histograms, observed as requests end, say little or nothing; doctor called it healthy, twice.


def timed(steps: list[Step], interval_s: float) -> list[Snapshot]:
    """The scrapes of `steps`, taken `interval_s` apart (as doctor takes them from a server)."""
    return [Snapshot.parse(p, time=i * interval_s) for i, p in enumerate(scrapes(steps))]


def test_a_queue_on_a_busy_host_is_a_finding_whatever_the_histograms_say() -> None:
    stuck = Step(requests=0, prompt_mean=70, ttft_mean=0.0, queue_mean=0.0, usage=0.004, running=2, waiting=6)
    found = diagnose(Evidence(timed([stuck] * 4, 5.0)))  # 20 s, nobody ended: waited 20 s at least
    assert [f.code for f in found] == ["requests_queued"]
    assert found[0].evidence["limited_by"] == "max_num_seqs" and found[0].evidence["queue_time_mean_s"] == 20.0
    assert found[0].evidence["queue_time_source"].startswith("num_requests_waiting")
    # A few ended, early arrivals that hardly waited (their histogram says 0.3 s); 6 stood waiting throughout:
    # Little's law, 6 waiting x 20 s / 8 ended, is 15 s.
    trickle = Step(requests=2, prompt_mean=70, ttft_mean=0.5, queue_mean=0.3, usage=0.004, running=2, waiting=6)
    found = diagnose(Evidence(timed([trickle] * 4, 5.0)))
    assert [f.code for f in found] == ["requests_queued"] and found[0].evidence["queue_time_mean_s"] == 15.0
    # Busy but fine: a burst or two waiting while 40 requests a window go through is a 0.25 s wait.
    flowing = Step(requests=40, prompt_mean=70, ttft_mean=0.4, queue_mean=0.2, usage=0.3, running=8, waiting=2)
    assert diagnose(Evidence(timed([flowing] * 4, 5.0))) == []


def test_doctor_against_a_server_under_injected_load(capsys) -> None:
    """Through the CLI against a server whose requests never end while the scrapes run (what a host busy with other
    work looks like from /metrics): a finding, not "healthy"."""
    import threading
    from http.server import ThreadingHTTPServer

    from test_doctor import FakeServer

    class Loaded(FakeServer):
        page = exposition(usage=0.004, running=2, waiting=6, requests=40, ttft_sum=20.0, queue_sum=8.0)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Loaded)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert main(["doctor", "--url", url, "--scrapes", "2", "--interval", "1.2", "--json"]) == 1
    finally:
        httpd.shutdown()
        httpd.server_close()
    doc = json.loads(capsys.readouterr().out)
    assert not doc["healthy"] and [f["code"] for f in doc["findings"]] == ["requests_queued"]
