"""The bench scaffolding without a model: workloads, output conventions, floors, llama-bench parsing."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch

from kvserve.bench.floor import model_cost
from kvserve.bench.machine import Ceilings, machine_info
from kvserve.bench.peers.llama_cpp import parse_llama_bench_depth_json, parse_llama_bench_json
from kvserve.bench.report import Report, Table, emit
from kvserve.bench.systems import Timeline
from kvserve.bench.workload import (
    TokenRange,
    random_token_requests,
    random_word_prompts,
)
from kvserve.model.config import ModelConfig


def test_token_range_parsing():
    assert TokenRange.parse("32-512") == TokenRange(32, 512)
    assert TokenRange.parse("64") == TokenRange(64, 64)
    for bad in ("0-4", "9-3", "a-b", "1-2-3", ""):
        with pytest.raises(ValueError):
            TokenRange.parse(bad)


def test_random_requests_are_reproducible_and_in_range():
    a = random_token_requests(20, TokenRange(3, 9), TokenRange(2, 5), vocab_size=50, seed=7, exclude=[0, 1, 2])
    b = random_token_requests(20, TokenRange(3, 9), TokenRange(2, 5), vocab_size=50, seed=7, exclude=[0, 1, 2])
    assert a == b
    assert all(3 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert all(0 < t < 50 and t not in (0, 1, 2) for r in a for t in r.prompt_token_ids)
    assert random_token_requests(5, TokenRange(4, 4), TokenRange(4, 4), 50, seed=8) != a[:5]
    words = random_word_prompts(6, TokenRange(48, 200), seed=0)
    assert len(words) == 6 and all(48 <= len(w.split()) <= 200 for w in words)


def test_timeline_splits_prefill_from_decode():
    t = Timeline(start=0.0, stamps=[0.5, 0.6, 0.8, 1.0], first_all=1)
    assert t.ttft_s == 0.6 and t.num_decode_steps == 2 and t.decode_step_s == pytest.approx(0.2)
    assert Timeline(start=0.0, stamps=[0.3]).decode_step_s is None


def test_a_stall_does_not_move_the_decode_step_time():
    """bench latency reported 1,698 ms a token after a 1,024-token prompt on the instruct model where the steps took
    23 ms: 31 steps, one of which met a 52 s stall of the host, averaged. The step time is now the median step (the
    mean is kept beside it, stalls included)."""
    steps = [0.023] * 30 + [52.0]
    stamps = [3.5]
    for s in steps:
        stamps.append(stamps[-1] + s)
    t = Timeline(start=0.0, stamps=stamps, first_all=0)
    assert t.decode_step_s == pytest.approx(0.023)
    assert t.decode_step_mean_s == pytest.approx(sum(steps) / 31) and t.decode_step_mean_s > 1.6
    assert t.decode_steps_s == pytest.approx(steps)


def _report() -> Report:
    r = Report("demo", machine_info(), {"flag": 1}, results={"x": [1.5]}, ratios={"a/b": 2.0}, notes=["n"])
    t = Table("T", ["name", "value"])
    t.add("row", 1.23456)
    r.tables.append(t)
    return r


def test_emit_follows_the_json_convention(tmp_path):
    out = io.StringIO()
    emit(_report(), "-", out)  # --json / --json -: JSON only on stdout
    doc = json.loads(out.getvalue())
    assert doc["schema"] == "kvserve.bench.demo/1" and doc["results"] == {"x": [1.5]}
    out = io.StringIO()
    path = tmp_path / "r.json"
    emit(_report(), str(path), out)  # --json PATH: the table on stdout, the JSON in the file
    assert "1.23" in out.getvalue() and "a/b = 2.00" in out.getvalue()
    assert json.loads(path.read_text())["ratios"] == {"a/b": 2.0}
    out = io.StringIO()
    emit(_report(), None, out)  # no --json: the table only
    assert out.getvalue().startswith("kvserve bench demo on ")
    with pytest.raises(ValueError):
        Table("T", ["a"]).add(1, 2)


def _config(tied: bool) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=100,
        hidden_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_ids=[2],
        sliding_windows=[4, None],
    )


class _Toy(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(100, 8)
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(8))
        self.lm_head = None if tied else torch.nn.Linear(8, 100, bias=False)


@pytest.mark.parametrize("tied", [True, False])
def test_model_cost_counts_what_a_step_must_read(tied):
    cost = model_cost(_Toy(tied), _config(tied), kv_bytes_per_token=2 * 2 * 1 * 4 * 4)
    # Tied: the embedding is the LM head, read whole. Untied: the lookup table is not read, the head is.
    assert cost.matmul_params == 800 + 64
    assert cost.weight_bytes_per_step == 4 * (800 + 64 + 8)
    assert cost.attended(10) == 4 + 10  # the sliding layer sees 4 keys, the global one all 10
    assert cost.decode_flops(10) == 2 * 864 + 4 * 2 * 4 * 14
    assert cost.lm_head_params == 800  # the LM head runs for the last prompt token only
    assert cost.prefill_flops(3) == 2 * (64 * 3 + 800) + 4 * 2 * 4 * (2 + 4 + 6)
    ceilings = Ceilings(copy_bandwidth_gbps=1.0, read_bandwidth_gbps=2.0, matmul_gflops=1.0)
    bytes_s = cost.decode_bytes(1, 10) / 2e9
    flops_s = cost.decode_flops(10) / 1e9
    assert cost.decode_floor_ms(ceilings, 1, 10) == pytest.approx(1e3 * max(bytes_s, flops_s))
    # int8 activations: the matmuls' FLOPs at the int8 rate, attention's at float32's; refused when not measured.
    with pytest.raises(ValueError, match="int8"):
        cost.decode_floor_ms(ceilings, 1, 10, int8=True)
    int8 = Ceilings(copy_bandwidth_gbps=1e-3, read_bandwidth_gbps=1e-3, matmul_gflops=1.0, int8_matmul_gops=4.0)
    compute_s = 2 * 864 / 4e9 + 4 * 2 * 4 * 14 / 1e9
    assert cost.decode_floor_ms(int8, 2, 10, int8=True) == pytest.approx(
        1e3 * max(cost.decode_bytes(2, 10) / 1e6, 2 * compute_s)
    )
    prefill_s = 2 * (64 * 3 + 800) / 4e9 + 4 * 2 * 4 * 12 / 1e9
    assert cost.prefill_floor_ms(int8, 3, int8=True) == pytest.approx(
        1e3 * max(cost.weight_bytes_per_step / 1e6, prefill_s)
    )


def test_llama_bench_json_parsing():
    rows = [
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 330.5},
        {"n_prompt": 32, "n_gen": 0, "avg_ts": 250.0},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 44.0},
    ]
    result = parse_llama_bench_json(json.dumps(rows), 128)
    assert result.prompt_tokens_per_s == {512: 330.5, 32: 250.0} and result.decode_tokens_per_s == 44.0


def test_llama_bench_depth_rows_are_told_apart():
    """llama-bench -d N adds n_depth to each test: the depth's tg is found by it, and the empty-context figures
    ignore depth rows."""
    rows = [
        {"n_prompt": 0, "n_gen": 32, "n_depth": 4096, "avg_ts": 30.0},
        {"n_prompt": 0, "n_gen": 32, "n_depth": 16384, "avg_ts": 20.0},
        {"n_prompt": 0, "n_gen": 32, "n_depth": 0, "avg_ts": 60.0},
    ]
    text = json.dumps(rows)
    assert parse_llama_bench_depth_json(text, 16384) == 20.0 and parse_llama_bench_depth_json(text, 8) is None
    assert parse_llama_bench_json(text, 32).decode_tokens_per_s == 60.0


def test_bench_help_documents_each_schema():
    from kvserve.cli import build_parser

    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "bench")[1]
    commands = bench._subparsers._group_actions[0].choices
    assert {"throughput", "latency", "serve", "kv-cache"} <= set(commands)
    for name, sub in commands.items():
        text = sub.format_help()
        assert "JSON schema" in text and "--json" in text and "--plot" in text, name
    assert isinstance(parser.parse_args(["bench", "latency", "--batch-sizes", "1,8"]), argparse.Namespace)


def test_latency_runs_an_outside_peer_between_the_halves_of_its_repeats(monkeypatch):
    """llama-bench's pp / tg (a peer outside the process) runs midway through kvserve's repeats, as --depth's
    llama-bench -d does, so that a host whose speed drifts during a run moves both systems alike."""
    from types import SimpleNamespace

    from kvserve.bench import latency, systems

    calls: list[str] = []

    class Recorder:
        name = "kvserve"

        def timed_generate(self, prompts: list[list[int]], output_len: int) -> Timeline:
            calls.append("kvserve")
            return Timeline(start=0.0, stamps=[0.1, 0.2, 0.3])

    monkeypatch.setattr(systems, "special_token_ids", lambda engine: [])
    engine = SimpleNamespace(core=SimpleNamespace(model_config=SimpleNamespace(vocab_size=50)))
    plan = latency.LatencyPlan([8], 2, [1], 4, 2, 4, 0)
    latency.measure([Recorder()], plan, engine, midway=lambda: calls.append("peer"))  # type: ignore[arg-type]
    # each repeat: one single-request run and one batch run; the peer before the third of four repeats
    assert calls == ["kvserve"] * 4 + ["peer"] + ["kvserve"] * 4
