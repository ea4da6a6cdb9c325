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
    LATENCY_DEPTH,
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


# A llama-bench stand-in for -d: one tg row at the depth it is asked for, its rate telling the cache type apart.
FAKE_DEPTH_BENCH = r"""#!/bin/sh
depth=0; ctk=f16
while [ $# -gt 0 ]; do
  case "$1" in
    -d) depth=$2; shift ;;
    -ctk) ctk=$2; shift ;;
  esac
  shift
done
rate=40.0; [ "$ctk" = q8_0 ] && rate=50.0
echo "[{\"n_prompt\": 0, \"n_gen\": 3, \"n_depth\": $depth, \"avg_ts\": $rate}]"
"""


def test_latency_at_depth_for_each_kv_dtype_and_llama_bench_d(tiny_model_dir, tmp_path, capsys):
    """--depth: kvserve at its own KV dtype and each --depth-kv-cache-dtypes one (an engine each), llama-bench -d at
    each cache type, rows with floors at each row's own KV bytes a token, ratios per depth, a third plot panel."""
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_DEPTH_BENCH)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    depth_args = ["--depth", "20,12", "--depth-kv-cache-dtypes", "bfloat16,int8", "--llama-cpp-kv-types", "f16,q8_0"]
    doc, table = run(
        [
            "latency",
            *("--prompt-lens", "8", "--output-len", "3", "--batch-sizes", "1", "--batch-prompt-len", "6"),
            *("--batch-output-len", "2", "--repeats", "2", *depth_args),
            *("--peer", "llama-cpp", "--llama-bench", str(fake), "--llama-cpp-model", str(fake)),
        ],
        tiny_model_dir,
        tmp_path,
        capsys,
    )
    results = doc["results"]
    assert set(results) == LATENCY_RESULTS | {"depth"}
    rows = results["depth"]
    assert all(set(r) == LATENCY_DEPTH for r in rows)
    systems = ["kvserve (float32 KV)", "kvserve (bfloat16 KV)", "kvserve (int8 KV)"]
    systems += ["llama.cpp (f16 KV)", "llama.cpp (q8_0 KV)"]
    assert sorted((r["system"], r["depth"]) for r in rows) == sorted((s, d) for s in systems for d in (12, 20))
    by = {(r["system"], r["depth"]): r for r in rows}
    for depth in (12, 20):
        f32, bf16, int8 = (by[(s, depth)] for s in systems[:3])
        assert len(f32["decode_ms_per_token_runs"]) == 2 and f32["decode_ms_per_token"] > 0
        # the floor counts each row's own KV bytes a token: 4 / 2 / 1 + a scale per head vector
        assert f32["kv_bytes_per_token"] == 2 * bf16["kv_bytes_per_token"] > int8["kv_bytes_per_token"]
        assert f32["floor_ms"] >= bf16["floor_ms"] >= int8["floor_ms"] > 0
        assert by[("llama.cpp (f16 KV)", depth)]["decode_ms_per_token"] == 1e3 / 40.0
        assert by[("llama.cpp (q8_0 KV)", depth)]["decode_ms_per_token"] == 1e3 / 50.0
        assert by[("llama.cpp (f16 KV)", depth)]["kv_bytes_per_token"] == bf16["kv_bytes_per_token"]
    ratios = doc["ratios"]
    assert "decode_speed@depth20:kvserve (bfloat16 KV)/llama.cpp (f16 KV)" in ratios
    assert "floor/kvserve (int8 KV) decode@depth12" in ratios
    assert "Decode over a cached prompt" in table


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
