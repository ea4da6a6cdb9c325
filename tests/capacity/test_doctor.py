"""kvserve doctor against fake /metrics expositions: one per finding, a healthy server, and an HTTP server
with the probe. Each exposition is written out in Prometheus text format, as the server publishes it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.tools.doctor_checks import Evidence, ProbeResult, diagnose
from kvserve.tools.metrics_snapshot import Snapshot

CACHE = dict(
    block_size="16", num_blocks="1000", kv_cache_dtype="bfloat16", enable_prefix_caching="True", max_model_len="8192"
)


def histogram(name: str, count: float, total: float) -> str:
    return (
        f"# TYPE {name} histogram\n"
        f'{name}_bucket{{le="0.5",model_name="m"}} {count / 2}\n{name}_bucket{{le="+Inf",model_name="m"}} {count}\n'
        f'{name}_count{{model_name="m"}} {count}\n{name}_sum{{model_name="m"}} {total}\n'
    )


def exposition(
    usage: float = 0.2,
    running: float = 8,
    waiting: float = 0,
    preemptions: float = 0,
    queries: float = 20000,
    hits: float = 10000,
    requests: float = 100,
    ttft_sum: float = 5.0,
    prompt_tokens: float = 50000,
    itl_count: float = 3000,
    itl_sum: float = 30.0,
    queue_sum: float | None = None,
    prefill_sum: float | None = None,
    **cache: str,
) -> str:
    """A kvserve /metrics page with these (cumulative) values; the queue and prefill histograms only if given."""
    labels = ",".join(f'{k}="{v}"' for k, v in {**CACHE, **cache}.items())
    gauges = {"kv_cache_usage_perc": usage, "num_requests_running": running, "num_requests_waiting": waiting}
    counters = {
        "num_preemptions": preemptions,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prompt_tokens": prompt_tokens,
        "generation_tokens": itl_count + requests,
    }
    text = "".join(f"# TYPE kvserve:{k} gauge\nkvserve:{k} {v}\n" for k, v in gauges.items())
    text += "".join(f"# TYPE kvserve:{k} counter\nkvserve:{k}_total {v}\n" for k, v in counters.items())
    text += histogram("kvserve:time_to_first_token_seconds", requests, ttft_sum)
    text += histogram("kvserve:inter_token_latency_seconds", itl_count, itl_sum)
    if queue_sum is not None:
        text += histogram("kvserve:request_queue_time_seconds", requests, queue_sum)
    if prefill_sum is not None:
        text += histogram("kvserve:request_prefill_time_seconds", requests, prefill_sum)
    return text + f"# TYPE kvserve:cache_config_info gauge\nkvserve:cache_config_info{{{labels}}} 1.0\n"


def codes(*pages: str, probe: ProbeResult | None = None) -> list[str]:
    return [f.code for f in diagnose(Evidence([Snapshot.parse(p) for p in pages], probe))]


def test_healthy_server_has_no_findings() -> None:
    assert codes(exposition()) == []


def growing_pages(ttft_steps: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)) -> list[str]:
    """Five scrapes, four windows of 10 requests whose mean prompt rises 500 -> 700 -> 1000 -> 1500 tokens."""
    requests, prompts, ttft = [100.0], [50000.0], [5.0]
    for prompt_sum, ttft_sum in zip((5000, 7000, 10000, 15000), ttft_steps, strict=True):
        requests.append(requests[-1] + 10)
        prompts.append(prompts[-1] + prompt_sum)
        ttft.append(ttft[-1] + ttft_sum)
    return [
        exposition(requests=r, prompt_tokens=p, ttft_sum=t) for r, p, t in zip(requests, prompts, ttft, strict=True)
    ]


def test_growing_prompts_across_scrapes() -> None:
    findings = diagnose(Evidence([Snapshot.parse(p) for p in growing_pages()]))
    assert [f.code for f in findings] == ["growing_prompts"]
    assert findings[0].evidence["prompt_len_mean_by_window"] == [500.0, 700.0, 1000.0, 1500.0]
    assert findings[0].evidence["ttft_mean_s_by_window"] == [0.1, 0.15, 0.2, 0.3]
    assert "--chat-history-policy truncate" in findings[0].fix
    # the same growth in prompts without TTFT growing with it is not a finding
    assert codes(*growing_pages((1.0, 1.0, 1.0, 1.2))) == []


def test_prompts_near_max_model_len() -> None:
    assert codes(exposition(prompt_tokens=600_000)) == ["growing_prompts"]  # 6000 of 8192 tokens on average


def test_kv_pressure_with_preemptions() -> None:
    findings = diagnose(
        Evidence(
            [Snapshot.parse(exposition(usage=0.97, preemptions=12, waiting=5))],
            ProbeResult([(64, 0.05)], [(1, 0.2, 0.01), (16, 1.0, 0.05)]),
        )
    )
    assert [f.code for f in findings] == ["kv_cache_pressure"]
    f = findings[0]
    assert f.evidence["kv_cache_usage_perc_max"] == 0.97 and f.evidence["preemptions"] == 12
    assert f.evidence["probe_latency_slowdown"] == 5.0 and "5.0x" in f.summary
    assert "--max-num-seqs" in f.fix and "fp8" in f.fix
    assert codes(exposition(usage=0.97)) == []  # full but nobody preempted: fine
    assert codes(exposition(usage=0.5, preemptions=3)) == []
    assert "--disable-hybrid-kv-cache-manager" not in f.fix


def test_kv_pressure_names_the_layout_that_keeps_out_of_window_blocks() -> None:
    """A model with sliding windows served with --disable-hybrid-kv-cache-manager (its cache_config says so): the
    first fix is to drop the flag; with the hybrid layout in force, or a model without windows, it is not named."""
    uniform = dict(hybrid_kv_cache_manager="False", sliding_window_layers="15")
    (f,) = diagnose(Evidence([Snapshot.parse(exposition(usage=0.97, preemptions=12, **uniform))]))
    assert f.code == "kv_cache_pressure" and f.evidence["sliding_window_layers"] == 15
    assert f.fix.startswith("First, this model has 15 sliding-window layers") and "--disable-hybrid" in f.fix
    for cache in (dict(hybrid_kv_cache_manager="True", sliding_window_layers="15"), dict(sliding_window_layers="0")):
        (f,) = diagnose(Evidence([Snapshot.parse(exposition(usage=0.97, preemptions=12, **cache))]))
        assert "--disable-hybrid-kv-cache-manager" not in f.fix


def test_memory_bandwidth_bound_decode() -> None:
    # 80 ms per token, 2 running requests holding 0.8 x 1000 blocks x 16 / 2 = 6400 tokens each
    page = exposition(usage=0.8, running=2, itl_sum=240.0)
    findings = diagnose(Evidence([Snapshot.parse(page)]))
    assert [f.code for f in findings] == ["memory_bandwidth_bound"]
    assert findings[0].evidence["cached_tokens_per_request"] == 6400
    assert codes(exposition(usage=0.8, running=2, itl_sum=240.0, kv_cache_dtype="fp8")) == []  # already 8-bit
    assert codes(exposition(usage=0.8, running=32, itl_sum=240.0)) == []  # a big batch: compute-bound


def test_low_prefix_hit_rate_and_caching_off() -> None:
    findings = diagnose(Evidence([Snapshot.parse(exposition(queries=50000, hits=1000))]))
    assert [f.code for f in findings] == ["low_prefix_hit_rate"]
    assert findings[0].evidence["hit_rate"] == 0.02 and "move the varying parts" in findings[0].fix.lower()
    assert codes(exposition(queries=500, hits=0)) == []  # too little traffic to judge
    assert codes(exposition(enable_prefix_caching="False")) == ["prefix_caching_off"]


def test_not_a_kvserve_exposition() -> None:
    with pytest.raises(ValueError, match="no kvserve: metrics"):
        Snapshot.parse("# TYPE other gauge\nother 1.0\n")


def test_cli_with_saved_scrapes(tmp_path: Path, capsys) -> None:
    healthy, sick = tmp_path / "healthy.txt", tmp_path / "sick.txt"
    healthy.write_text(exposition())
    sick.write_text(exposition(usage=0.95, preemptions=4))
    assert main(["doctor", "--metrics-file", str(healthy)]) == 0
    assert "Healthy" in capsys.readouterr().out
    assert main(["doctor", "--metrics-file", str(sick), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["healthy"] and doc["findings"][0]["code"] == "kv_cache_pressure"
    assert doc["cache_config"]["num_blocks"] == "1000" and doc["summary"]["prefix_cache_hit_rate"] == 0.5


class FakeServer(BaseHTTPRequestHandler):
    """/metrics, /v1/models and /v1/completions, enough for doctor and its probe."""

    page = exposition()
    completions = 0

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(self.page.encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(json.dumps({"object": "list", "data": [{"id": "gemma-3-270m"}]}).encode(), "application/json")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "gemma-3-270m" and body["prompt"]
        type(self).completions += 1
        self._send(json.dumps({"choices": [{"text": "x"}]}).encode(), "application/json")

    def _send(self, data: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_url_with_probe(server: str, capsys) -> None:
    code = main(
        [
            "doctor",
            "--url",
            server,
            "--scrapes",
            "2",
            "--interval",
            "0",
            "--probe",
            "--probe-prompt-lens",
            "8,32",
            "--probe-concurrency",
            "1,3",
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["healthy"] and doc["models"] == ["gemma-3-270m"] and doc["scrapes"] == 2
    assert [r["prompt_tokens"] for r in doc["probe"]["ttft_by_prompt_len"]] == [8, 32]
    assert [r["concurrency"] for r in doc["probe"]["latency_by_concurrency"]] == [1, 3]
    assert FakeServer.completions == 2 + 1 + 3
    assert any("no requests" in n for n in doc["notes"])  # the fake counters did not move between scrapes


def test_unreachable_server(capsys) -> None:
    assert main(["doctor", "--url", "http://127.0.0.1:9", "--scrapes", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
