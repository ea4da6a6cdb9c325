"""`kvserve bench long-context` end to end on a tiny checkpoint with sliding windows (Gemma 3's shape, window 8,
blocks of 4) and a stand-in llama-server: every section runs, the report keeps its schema, and the figures that do not
depend on timing hold (the capacity arithmetic, estimate's agreement, the peak blocks of the dry run, preemption
counts). Timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_schema import assert_png, load_report
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer

from kvserve.cli import main


@pytest.fixture(scope="module")
def sliding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench_sliding") / "gemma3_mqa_sliding"
    build_tiny_hf_model("gemma3_mqa_sliding").save_pretrained(path)
    write_char_tokenizer(path)
    return path


SMALL = [
    "--block-size", "4", "--cpu-threads", "1", "--max-num-batched-tokens", "32",
    "--capacity-budget", "2MiB", "--capacity-max-model-len", "200", "--capacity-requests", "2",
    "--throughput-requests", "3", "--throughput-prompt-len", "60-100", "--throughput-output-len", "4",
    "--throughput-pool", "160KiB",
    "--decode-context", "40", "--decode-batches", "1,2", "--decode-steps", "2", "--repeats", "1",
    "--chat-users", "2", "--chat-rounds", "2", "--chat-system-tokens", "40", "--chat-question-tokens", "10",
    "--chat-output-len", "4",
    "--chat-pool", "96KiB", "--chat-tier", "1MiB",
]  # fmt: skip


def test_bench_long_context(sliding_model_dir, fake_llama_server, tmp_path, capsys):
    out_json, png = tmp_path / "long_context.json", tmp_path / "long_context.png"
    argv = ["--log-level", "WARNING", "bench", "long-context", "--model", str(sliding_model_dir), *SMALL]
    assert main([*argv, "--llama-server", str(fake_llama_server), "--json", str(out_json), "--plot", str(png)]) == 0
    doc = load_report(out_json, "long-context")
    capacity = doc["results"]["capacity"]
    hybrid, uniform = capacity["layouts"]["hybrid"], capacity["layouts"]["uniform"]
    # Three KV cache groups of one layer (one full-attention, two sliding) against one group of all three layers.
    assert hybrid["bytes_per_block"] * 3 == uniform["bytes_per_block"]
    # A 200-token request: the full group's 50 blocks and each sliding group's window (tokens 192-199: 2 blocks)
    assert hybrid["blocks_per_request"] == 50 + 2 * 2 and uniform["blocks_per_request"] == 50
    for row in (hybrid, uniform):  # estimate predicts the engine's plan to the block
        assert row["estimate_num_blocks"] == row["num_blocks"]
        assert row["estimate_blocks_per_request"] == row["blocks_per_request"]
    assert hybrid["max_concurrency"] > 2 * uniform["max_concurrency"]
    # Two requests of 200 tokens held at once: every block of the full group, and the sliding groups' windows
    # plus a prefill chunk (the uniform layout: every block of three layers).
    # (at the peak the first request may be a token or two short of its last block)
    assert 2 * 50 - 2 <= hybrid["peak_blocks"] <= 2 * (50 + 2 * 2) + hybrid["prefill_reserve_blocks"]
    assert 2 * 50 - 2 <= uniform["peak_blocks"] <= 2 * 50
    assert hybrid["kv_bytes"] < uniform["kv_bytes"] / 2
    assert (
        capacity["llama_server"]["kv_bytes"] == 27 * 2**20
        and capacity["llama_server"]["swa_full_kv_bytes"] == 120 * 2**20
    )
    started = json.loads((fake_llama_server.parent / "args.json").read_text())
    assert "-np" in started and "--swa-full" not in started  # the last start: the throughput peer's
    throughput = doc["results"]["throughput"]["systems"]
    assert set(throughput) == {"hybrid", "uniform", "llama-server"}
    assert throughput["uniform"]["preemptions"] >= throughput["hybrid"]["preemptions"]
    assert throughput["hybrid"]["peak_kv_bytes"] <= 160 * 1024
    decode = doc["results"]["decode"]["rows"]
    assert [r["batch"] for r in decode] == [1, 2] and all(r["hybrid"] > 0 and r["uniform"] > 0 for r in decode)
    chat = doc["results"]["chat"]["systems"]
    assert set(chat) == {"hybrid", "uniform", "hybrid + tier", "uniform + tier"}
    assert all(len(row["ttft_ms"]) == 4 for row in chat.values())
    assert chat["hybrid"]["pool_hit_rate"] > 0  # the second round of each user hits its first round's history
    for key in (
        "max_concurrency_hybrid_over_uniform",
        "throughput_hybrid_over_uniform",
        "chat_ttft_p50_hybrid_over_uniform",
    ):
        assert doc["ratios"][key] is not None and doc["ratios"][key] > 0
    assert_png(png)
    assert "Capacity of" in capsys.readouterr().out
