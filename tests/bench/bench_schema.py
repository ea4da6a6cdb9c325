"""The documented JSON schemas of the bench commands, restated as key sets the tests check against."""

from __future__ import annotations

import json
from pathlib import Path

ENVELOPE = {"schema", "command", "created_utc", "machine", "config", "results", "ratios", "notes", "tables"}
MACHINE = {"cpu_model", "logical_cpus", "torch_threads", "memory_gib", "python", "torch", "transformers", "platform"}
SUMMARY = {"count", "mean", "p50", "p90", "p99", "min", "max"}

THROUGHPUT_RESULTS = {"workload", "systems", "hf_batch_probes"}
THROUGHPUT_SYSTEM = {
    "system",
    "runs",
    "elapsed_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "batch_size",
}
THROUGHPUT_RUN = {"elapsed_s", "prompt_tokens", "output_tokens", "generated_tokens"}

LATENCY_RESULTS = {"single", "batch", "ceilings", "model_cost"}
LATENCY_SINGLE = {
    "system",
    "prompt_len",
    "output_len",
    "ttft_ms",
    "ttft_ms_runs",
    "decode_ms_per_token",
    "decode_ms_per_token_runs",
    "decode_ms_per_token_mean_runs",
    "decode_tokens_per_s",
    "prefill_floor_ms",
    "decode_floor_ms",
}
LATENCY_DEPTH = {
    "system",
    "kv_cache_dtype",
    "depth",
    "output_len",
    "decode_ms_per_token",
    "decode_ms_per_token_runs",
    "kv_bytes_per_token",
    "floor_ms",
}
LATENCY_BATCH = {
    "system",
    "batch_size",
    "prompt_len",
    "output_len",
    "ms_per_step",
    "ms_per_step_runs",
    "ms_per_token",
    "tokens_per_s",
    "floor_ms_per_step",
}
CEILINGS = {"copy_bandwidth_gbps", "read_bandwidth_gbps", "matmul_gflops", "int8_matmul_gops", "bandwidth_gbps_used"}
MODEL_COST = {
    "weight_bytes_per_step",
    "matmul_params",
    "lm_head_params",
    "kv_bytes_per_token",
    "num_layers",
    "num_heads",
    "head_dim",
    "sliding_windows",
}

KV_CACHE_RESULTS = {"points", "decode_tokens"}
KV_CACHE_POINT = {
    "context_len",
    "cached_ms_per_token",
    "cached_ms_runs",
    "recompute_ms_per_token",
    "recompute_ms_runs",
    "speedup",
}

SERVE_RESULTS = {"workload", "levels"}
SERVE_LEVEL = {
    "server",
    "url",
    "model",
    "max_concurrency",
    "request_rate",
    "rounds",
    "completed",
    "failed",
    "errors",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_ms",
    "itl_ms",
    "e2e_ms",
}


def load_report(path: Path, command: str) -> dict:
    """Parse a report (strict JSON: no NaN) and check the envelope every command shares."""
    doc = json.loads(path.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert set(doc) == ENVELOPE
    assert doc["schema"] == f"kvserve.bench.{command}/1" and doc["command"] == command
    assert set(doc["machine"]) == MACHINE
    assert all(isinstance(v, (float, type(None))) for v in doc["ratios"].values())
    return doc


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000
