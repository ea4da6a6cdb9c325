"""`kvserve bench prefix` end to end on a tiny checkpoint: both scenarios run, caching on gets hits and
caching off gets none, the JSON has the documented shape and the plot is drawn. Timings are not asserted."""

from __future__ import annotations

from bench_schema import assert_png, load_report

from kvserve.cli import main


def test_bench_prefix_reports_both_scenarios(tiny_model_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "prefix.json", tmp_path / "prefix.png"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "prefix",
        "--model",
        str(tiny_model_dir),
        "--requests",
        "3",
        "--system-tokens",
        "40",
        "--question-tokens",
        "5",
        "--turns",
        "3",
        "--turn-user-tokens",
        "6",
        "--output-len",
        "4",
        "--block-size",
        "4",
        "--kv-cache-memory-bytes",
        "8MiB",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    assert main(argv) == 0
    assert_png(out_png)
    doc = load_report(out_json, "prefix")
    shared = doc["results"]["shared_prompt"]
    assert shared["requests"] == 3 and shared["system_tokens"] == 41  # BOS + 40
    assert shared["on"]["hit_rate"] > 0.5 and shared["off"]["hit_rate"] == 0.0
    assert len(shared["on"]["warm_ttft_ms"]) == 2
    turns = doc["results"]["multi_turn"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["cached_tokens_on"] == 0 and turns[2]["cached_tokens_on"] > turns[1]["cached_tokens_on"] > 0
    assert turns[2]["prompt_tokens"] == 41 + 3 * 6 + 2 * 4
    assert set(doc["ratios"]) == {"warm_over_cold_on", "warm_off_over_on", "last_turn_off_over_on"}
    assert "Multi-turn chat" in capsys.readouterr().out
