"""Each engine-backed bench command end to end on a tiny checkpoint: runs, writes JSON with the documented
schema, draws a PNG. Figures are not asserted (DESIGN.md: performance lives in the docs, not in tests)."""

from __future__ import annotations

import functools
import json
import stat

import pytest
from bench_schema import (
    CEILINGS,
    KV_CACHE_POINT,
    KV_CACHE_RESULTS,
    LATENCY_BATCH,
    LATENCY_RESULTS,
    LATENCY_SINGLE,
    MODEL_COST,
    THROUGHPUT_RESULTS,
    THROUGHPUT_RUN,
    THROUGHPUT_SYSTEM,
    assert_png,
    load_report,
)

from kvserve.bench import machine
from kvserve.cli import main

ENGINE = ["--kv-cache-memory-bytes", "8MiB", "--block-size", "4"]


@pytest.fixture(autouse=True)
def quick_ceilings(monkeypatch):
    """Small ceiling measurements: the tests check the plumbing, and the full ones take seconds."""
    monkeypatch.setattr(
        machine, "measure_ceilings", functools.partial(machine.measure_ceilings, buffer_mib=8, matmul_n=256, repeats=2)
    )


def run(command: list[str], model_dir, tmp_path, capsys) -> tuple[dict, str]:
    out_json, out_png = tmp_path / "report.json", tmp_path / "plot.png"
    argv = ["bench", *command, "--model", str(model_dir), "--json", str(out_json), "--plot", str(out_png)]
    assert main(["--log-level", "WARNING", *argv, *ENGINE]) == 0
    assert_png(out_png)
    return load_report(out_json, command[0]), capsys.readouterr().out


def test_throughput_with_hf_peer(tiny_model_dir, tmp_path, capsys):
    doc, table = run(
        [
            "throughput",
            "--num-requests",
            "6",
            "--input-len",
            "4-24",
            "--output-len",
            "2-8",
            "--peer",
            "hf",
            "--hf-max-batch-size",
            "4",
        ],
        tiny_model_dir,
        tmp_path,
        capsys,
    )
    results = doc["results"]
    assert set(results) == THROUGHPUT_RESULTS
    assert [s["system"] for s in results["systems"]] == ["kvserve", "hf"]
    for system in results["systems"]:
        assert set(system) == THROUGHPUT_SYSTEM and len(system["runs"]) == 1
        assert set(system["runs"][0]) == THROUGHPUT_RUN
        assert system["output_tokens_per_s"] > 0
    kv, hf = results["systems"]
    assert kv["runs"][0]["output_tokens"] == hf["runs"][0]["output_tokens"]  # the very same requests
    assert hf["runs"][0]["generated_tokens"] >= hf["runs"][0]["output_tokens"]
    assert hf["batch_size"] in {p["batch_size"] for p in results["hf_batch_probes"]}
    assert set(doc["ratios"]) == {"output_tokens_per_s:kvserve/hf", "total_tokens_per_s:kvserve/hf"}
    assert "kvserve" in table and "Ratios" in table


def test_latency_with_hf_and_a_llama_bench_stand_in(tiny_model_dir, tmp_path, capsys):
    rows = [
        {"n_prompt": 8, "n_gen": 0, "avg_ts": 400.0},
        {"n_prompt": 40, "n_gen": 0, "avg_ts": 800.0},
        {"n_prompt": 0, "n_gen": 3, "avg_ts": 50.0},
    ]
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\ncat <<'JSON'\n{json.dumps(rows)}\nJSON\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    doc, _ = run(
        [
            "latency",
            "--prompt-lens",
            "8,40",
            "--output-len",
            "3",
            "--batch-sizes",
            "1,3",
            "--batch-prompt-len",
            "6",
            "--batch-output-len",
            "3",
            "--repeats",
            "1",
            "--peer",
            "hf",
            "--peer",
            "llama-cpp",
            "--llama-bench",
            str(fake),
            "--llama-cpp-model",
            str(fake),
        ],
        tiny_model_dir,
        tmp_path,
        capsys,
    )
    results = doc["results"]
    assert set(results) == LATENCY_RESULTS
    assert set(results["ceilings"]) == CEILINGS and set(results["model_cost"]) == MODEL_COST
    assert {(r["system"], r["prompt_len"]) for r in results["single"]} == {
        (s, n) for s in ("kvserve", "hf", "llama.cpp") for n in (8, 40)
    }
    assert all(set(r) == LATENCY_SINGLE for r in results["single"])
    assert all(set(r) == LATENCY_BATCH for r in results["batch"])
    llama = next(r for r in results["single"] if r["system"] == "llama.cpp" and r["prompt_len"] == 40)
    assert llama["ttft_ms"] == 50.0 and llama["decode_tokens_per_s"] == 50.0  # 40 tokens at 800/s; tg 50/s
    kv = [r for r in results["batch"] if r["system"] == "kvserve"]
    assert [r["batch_size"] for r in kv] == [1, 3] and all(r["ms_per_step"] > 0 for r in kv)
    assert "decode_speed@batch1:kvserve/hf" in doc["ratios"]
    assert "decode_speed@batch1:kvserve/llama.cpp" in doc["ratios"]


def test_latency_skips_llama_cpp_without_a_binary(tiny_model_dir, tmp_path, capsys):
    doc, _ = run(
        [
            "latency",
            "--prompt-lens",
            "8",
            "--output-len",
            "2",
            "--batch-sizes",
            "2",
            "--batch-prompt-len",
            "4",
            "--batch-output-len",
            "2",
            "--repeats",
            "1",
            "--peer",
            "llama-cpp",
        ],
        tiny_model_dir,
        tmp_path,
        capsys,
    )
    assert {r["system"] for r in doc["results"]["single"]} == {"kvserve"}
    assert any("llama.cpp peer skipped" in n for n in doc["notes"])


def test_kv_cache(tiny_model_dir, tmp_path, capsys):
    doc, table = run(
        ["kv-cache", "--context-lens", "8,32,96", "--decode-tokens", "2", "--repeats", "2"],
        tiny_model_dir,
        tmp_path,
        capsys,
    )
    results = doc["results"]
    assert set(results) == KV_CACHE_RESULTS and results["decode_tokens"] == 2
    assert [p["context_len"] for p in results["points"]] == [8, 32, 96]
    for point in results["points"]:
        assert set(point) == KV_CACHE_POINT and len(point["cached_ms_runs"]) == 2
        assert point["cached_ms_per_token"] > 0 and point["recompute_ms_per_token"] > 0
    assert set(doc["ratios"]) == {"speedup@8", "speedup@32", "speedup@96"}
    assert "recompute" in table


def test_json_on_stdout_replaces_the_table(tiny_model_dir, capsys):
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "kv-cache",
        "--model",
        str(tiny_model_dir),
        "--context-lens",
        "8",
        "--decode-tokens",
        "1",
        "--repeats",
        "1",
        "--json",
        *ENGINE,
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "kv-cache" and len(doc["results"]["points"]) == 1
