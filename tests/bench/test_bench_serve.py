"""The serve benchmark's client against fake OpenAI streaming servers: latencies, token counts, failures,
a peer server in the same run, and the JSON schema."""

from __future__ import annotations

import asyncio

from bench_schema import SERVE_LEVEL, SERVE_RESULTS, SUMMARY, assert_png, load_report
from fake_openai_server import FakeBehaviour, fake_server

from kvserve.bench.serve_client import Endpoint, run_load
from kvserve.cli import main


def test_client_measures_a_stream():
    with fake_server(FakeBehaviour(token_delay_s=0.005, send_usage=False)) as url:
        run = asyncio.run(
            run_load(
                Endpoint(url),
                ["a b c"] * 3,
                max_tokens=5,
                ignore_eos=True,
                max_concurrency=2,
                request_rate=float("inf"),
                seed=0,
                timeout_s=10,
            )
        )
    assert run.model == "fake-model"  # discovered from /v1/models
    assert len(run.completed) == 3
    for r in run.completed:
        assert r.output_tokens == 5  # no usage report: one token per text chunk
        assert len(r.itl_s) == 4 and r.ttft_s is not None and r.ttft_s <= r.e2e_s
        last_arrival = r.ttft_s + sum(r.itl_s)
        assert all(gap >= 0 for gap in r.itl_s) and 5 * 0.005 <= last_arrival <= r.e2e_s  # 5 sleeps before it


def test_failures_are_counted_not_fatal():
    with fake_server(FakeBehaviour(fail_every=2)) as url:
        run = asyncio.run(
            run_load(
                Endpoint(url),
                ["x"] * 4,
                max_tokens=2,
                ignore_eos=True,
                max_concurrency=1,
                request_rate=50.0,
                seed=0,
                timeout_s=10,
            )
        )
        unknown = asyncio.run(run_load(Endpoint(url, model="nope"), ["x"], 2, True, 1, float("inf"), 0, 10))
    assert len(run.completed) == 2 and sum(not r.ok for r in run.results) == 2
    assert all("HTTP 500" in (r.error or "") for r in run.results if not r.ok)
    assert not unknown.results[0].ok and "HTTP 404" in unknown.results[0].error
    closed = asyncio.run(run_load(Endpoint("http://127.0.0.1:9"), ["x"], 2, True, 1, float("inf"), 0, 2))
    assert not closed.results[0].ok  # nothing listening: a failed request, not an exception


def test_serve_command_with_peer(tmp_path, capsys):
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    with fake_server() as url, fake_server(FakeBehaviour(token_delay_s=0.004)) as peer:
        code = main(
            [
                "bench",
                "serve",
                "--url",
                url,
                "--peer-url",
                peer + "/v1",
                "--num-prompts",
                "4",
                "--prompt-words",
                "5-10",
                "--max-tokens",
                "3",
                "--max-concurrency",
                "1,4",
                "--repeats",
                "2",
                "--json",
                str(out_json),
                "--plot",
                str(out_png),
            ]
        )
    assert code == 0
    assert_png(out_png)
    doc = load_report(out_json, "serve")
    results = doc["results"]
    assert set(results) == SERVE_RESULTS
    assert {(lv["server"], lv["max_concurrency"]) for lv in results["levels"]} == {
        (s, c) for s in ("target", "peer") for c in (1, 4)
    }
    for level in results["levels"]:
        assert set(level) == SERVE_LEVEL
        assert level["completed"] == 8 and level["failed"] == 0 and len(level["rounds"]) == 2
        assert set(level["ttft_ms"]) == SUMMARY and level["itl_ms"]["count"] == 8 * 2
        assert level["model"] == "fake-model"
    assert set(doc["ratios"]) == {"output_tokens_per_s@c1:target/peer", "output_tokens_per_s@c4:target/peer"}
    assert "TTFT p50" in capsys.readouterr().out
