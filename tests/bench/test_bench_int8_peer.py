"""`--peer kvserve-int8` in `bench latency` and `bench throughput`: kvserve's exact path and int8 activations
(#30) side by side in one run, on a tiny GGUF file (int8 activations need GGUF blocks). Checks the rows, that
the int8 rows are floored at the int8 matmul rate (measured, so their compute floor is below the exact path's),
the ratio keys both ways, and that a run already on int8 activations is refused."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from bench_schema import load_report

from kvserve.bench import machine
from kvserve.cli import main

MODELS_TESTS = Path(__file__).parents[1] / "models"
ENGINE = ["--kv-cache-memory-bytes", "8MiB", "--block-size", "4", "--max-num-batched-tokens", "64"]


@pytest.fixture(autouse=True)
def quick_ceilings(monkeypatch):
    """Small ceiling measurements (the plumbing is under test, and the full ones take seconds)."""
    monkeypatch.setattr(
        machine, "measure_ceilings", functools.partial(machine.measure_ceilings, buffer_mib=8, matmul_n=256, repeats=2)
    )


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    sys.path.insert(0, str(MODELS_TESTS))
    try:
        from test_gguf import tiny_gguf
    finally:
        sys.path.remove(str(MODELS_TESTS))
    _, source = tiny_gguf("llama", tmp_path_factory.mktemp("gguf"), with_vocab=True)
    return source.path


def bench(command: list[str], model: Path, tmp_path: Path) -> dict:
    out = tmp_path / "report.json"
    argv = ["--log-level", "WARNING", "bench", *command, "--model", str(model), "--json", str(out), *ENGINE]
    assert main([*argv, "--quantization", "gguf", "--peer", "kvserve-int8"]) == 0
    return load_report(out, command[0])


def test_latency_with_the_int8_peer(tiny_gguf, tmp_path):
    doc = bench(
        ["latency", "--prompt-lens", "8", "--output-len", "3", "--batch-sizes", "1,3", "--batch-prompt-len", "6"]
        + ["--batch-output-len", "3", "--repeats", "1"],
        tiny_gguf,
        tmp_path,
    )
    results, ratios = doc["results"], doc["ratios"]
    assert {r["system"] for r in results["single"]} == {"kvserve", "kvserve-int8"}
    assert results["ceilings"]["int8_matmul_gops"] > 0
    floors = {r["system"]: r["prefill_floor_ms"] for r in results["single"]}
    # The int8 prefill floor is below the exact one where integer matmuls outrun float32 ones (VNNI hosts), and equal
    # to it on an AVX2 host, whose torch._int_mm is the slower of the two (the floor takes the better rate).
    ceilings = results["ceilings"]
    if ceilings["int8_matmul_gops"] > ceilings["matmul_gflops"]:
        assert floors["kvserve-int8"] < floors["kvserve"]
    else:
        assert floors["kvserve-int8"] == pytest.approx(floors["kvserve"])
    for key in (
        "prefill_speed@prompt8:kvserve-int8/kvserve",
        "decode_speed@batch3:kvserve-int8/kvserve",
        "prefill_speed@prompt8:kvserve/kvserve-int8",
        "floor/kvserve-int8 decode@batch3",
    ):
        assert ratios[key] is not None and ratios[key] > 0, key


def test_throughput_with_the_int8_peer(tiny_gguf, tmp_path):
    doc = bench(
        ["throughput", "--num-requests", "4", "--input-len", "4-12", "--output-len", "2-5"], tiny_gguf, tmp_path
    )
    assert [r["system"] for r in doc["results"]["systems"]] == ["kvserve", "kvserve-int8"]
    assert doc["ratios"]["output_tokens_per_s:kvserve-int8/kvserve"] > 0


def test_the_int8_peer_needs_an_exact_kvserve(tiny_gguf, tmp_path):
    argv = ["--log-level", "WARNING", "bench", "latency", "--model", str(tiny_gguf), "--quantization", "gguf"]
    with pytest.raises(SystemExit, match="activation-quantization none"):
        main([*argv, "--activation-quantization", "int8", "--peer", "kvserve-int8", *ENGINE])
