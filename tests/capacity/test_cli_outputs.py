"""The estimate/advise command lines: table, --json on stdout or into a file, --plot, the scenarios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_on_stdout_and_json_in_a_file(capsys, tmp_path: Path) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--model", "llama-3.1-8b", "--memory", "80GiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 (K and V) x 32 layers x 8 kv_heads x 128 head_dim" in text and "= 131072 bytes" in text
    doc = json.loads(out.read_text())
    assert doc["kv"][0]["bytes_per_token"] == 131072
    assert doc["dtype"] == "bfloat16" and doc["device"] == "cuda"


def test_memory_formula_subtracts_the_weights(capsys) -> None:
    doc = run_json(
        capsys,
        "estimate",
        "--model",
        "llama-3.1-8b",
        "--memory",
        "80GiB",
        "--overhead",
        "1GiB",
        "--seq-len",
        "8k",
        "--batch",
        "1,8",
    )
    weights = 8_030_000_000 * 2
    budget = int(80 * 2**30 * 0.9) - weights - 2**30
    assert doc["weights"]["bytes"] == weights and doc["budget"]["kv_bytes"] == budget
    kv = doc["kv"][0]
    blocks = budget // (131072 * 16)
    assert kv["plan"]["num_blocks"] == blocks
    row = kv["seq_lens"][0]
    assert row["seq_len"] == 8192 and row["bytes_per_request"] == 8192 * 131072
    assert row["batches"][1] == {"batch": 8, "bytes": 8 * 8192 * 131072, "uniform_bytes": 8 * 8192 * 131072}
    assert kv["plan"]["num_usable_blocks"] == blocks - 1  # block 0 is the null block
    assert row["max_concurrent_requests"] == (blocks - 1) // 512
    assert kv["max_model_len_at_concurrency"][1] == {"concurrency": 8, "max_model_len": (blocks - 1) // 8 * 16}


def test_several_kv_dtypes_and_the_hybrid_layout(capsys) -> None:
    doc = run_json(
        capsys,
        "estimate",
        "--model",
        "google/gemma-3-270m",
        "--kv-cache-dtype",
        "float32,int8",
        "--seq-len",
        "32768",
        "--batch",
        "1",
        "--kv-cache-memory-bytes",
        "4GiB",
    )
    f32, i8 = doc["kv"]
    assert f32["bytes_per_token"] == 36864 and i8["bytes_per_token"] == 2 * 18 * (256 + 4)
    # 6 KV cache groups of 3 layers: one full-attention group (every block), five sliding ones (the window's)
    assert [g["kind"] for g in doc["layout"]["groups"]] == ["full_attention"] + ["sliding_window"] * 5
    row = f32["seq_lens"][0]
    assert row["blocks_by_group"] == [2048] + [32] * 5 and row["blocks_per_request"] == 2208
    assert row["bytes_per_request"] == 2208 * 3 * 2048 * 16 == 217_055_232  # 3 global + 15 x 512-token windows
    assert row["uniform_bytes_per_request"] == 32768 * 36864  # every layer keeps every token
    # 43690 blocks (one the null block); 645 kept for one 2048-token prefill chunk of the sliding groups
    assert f32["plan"]["num_blocks"] == 43690 and f32["plan"]["prefill_reserve_blocks"] == 645
    assert row["max_concurrent_requests"] == (43689 - 645) // 2208 == 19
    assert row["max_concurrent_requests_uniform"] == 3


def test_compare_contiguous(capsys) -> None:
    doc = run_json(
        capsys,
        "estimate",
        "--model",
        "llama-3.1-8b",
        "--kv-cache-memory-bytes",
        "64GiB",
        "--dtype",
        "bfloat16",
        "--compare-contiguous",
        "--requests",
        "10",
        "--avg-len",
        "1000",
        "--max-len",
        "8192",
    )
    c = doc["compare_contiguous"]
    # contiguous reserves 8192 tokens each; paged rounds 1000 up to 63 blocks = 1008 tokens
    assert c["contiguous"]["allocated_bytes"] == 10 * 8192 * 131072
    assert c["paged"]["allocated_bytes"] == 10 * 1008 * 131072
    assert c["contiguous"]["requests_that_fit"] == (64 << 30) // (8192 * 131072) == 64
    assert c["paged"]["requests_that_fit"] == (64 << 30) // (1008 * 131072) == 520


def test_plot(tmp_path: Path, capsys) -> None:
    png = tmp_path / "kv.png"
    assert main(["estimate", "--model", "mistral-7b-v0.1", "--kv-cache-dtype", "bfloat16,fp8", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_model_lists_the_catalog(capsys) -> None:
    assert main(["estimate", "--model", "no-such-model"]) == 2
    assert "llama-3.1-8b" in capsys.readouterr().err


def test_advise_keeps_16bit_kv_when_it_is_enough(capsys) -> None:
    # Llama 3.1 8B, 80 GiB: budget = 80 GiB x 0.9 - 16.06 GB weights; bf16 blocks = budget // 2 MiB = 29205;
    # chat: 8192 tokens -> 512 blocks, typical 2048 -> 128 blocks: 228 typical requests >= 32 expected.
    doc = run_json(capsys, "advise", "--model", "llama-3.1-8b", "--memory", "80GiB", "--scenario", "real_time_chat")
    r = doc["recommendation"]
    assert (r["max_model_len"], r["kv_cache_dtype"], r["max_num_seqs"]) == (8192, "bfloat16", 228)
    assert doc["warnings"] == []
    row = next(c for c in doc["candidates"] if c["max_model_len"] == 8192 and c["kv_cache_dtype"] == "bfloat16")
    assert row["max_concurrent_requests"] == 29204 // 512  # 29205 blocks, one the null block


def test_advise_switches_to_8bit_kv_and_warns(capsys) -> None:
    # 24 GiB: budget 7,132,823,398 bytes; bf16 3401 blocks (26 typical chats < 32); fp8 blocks of 1,081,344 bytes:
    # 6596 -> 51 typical chats, but only 12 at the full 8192 tokens, fewer than 32: a preemption warning.
    doc = run_json(capsys, "advise", "--model", "llama-3.1-8b", "--memory", "24GiB", "--scenario", "real_time_chat")
    r = doc["recommendation"]
    assert (r["kv_cache_dtype"], r["max_num_seqs"]) == ("fp8", 51)
    assert len(doc["warnings"]) == 1 and "only 12 fit" in doc["warnings"][0]
    assert "bfloat16 KV would hold only 26" in doc["explanation"]


def test_advise_warns_below_expected_concurrency(capsys) -> None:
    doc = run_json(
        capsys,
        "advise",
        "--model",
        "qwen3-8b",
        "--memory",
        "24GiB",
        "--scenario",
        "long_document_analysis",
        "--expected-concurrency",
        "4",
    )
    assert doc["recommendation"]["max_model_len"] == 40960  # the model's context, below the 131072 wanted
    assert any("context is 40960" in w for w in doc["warnings"])
    assert any("fewer than the expected 4" in w for w in doc["warnings"])


def test_advise_on_a_catalog_name_prints_a_command_that_runs(capsys, tmp_path: Path) -> None:
    """`advise --model lfm2-1.2b` printed `kvserve serve --model lfm2-1.2b`, which serve refuses (a catalog name is
    facts, not weights): the command names a directory to download the weights into, says how, and parses as serve's;
    serve itself, given the catalog name, says the same. A config.json's command names its checkpoint directory."""
    import shlex

    from kvserve.cli import build_parser

    doc = run_json(capsys, "advise", "--model", "lfm2-1.2b", "--memory", "8GiB")
    r = doc["recommendation"]
    assert r["command"].startswith("kvserve serve --model /path/to/LFM2-1.2B ")
    assert r["weights"].startswith("not on this machine: hf download LiquidAI/LFM2-1.2B --local-dir /path/to/LFM2-1.2B")
    args = build_parser().parse_args(shlex.split(r["command"])[1:])
    assert args.model == "/path/to/LFM2-1.2B" and args.max_model_len == r["max_model_len"]
    assert main(["advise", "--model", "lfm2-1.2b", "--memory", "8GiB"]) == 0
    assert "Weights: not on this machine: hf download LiquidAI/LFM2-1.2B" in capsys.readouterr().out
    assert main(["serve", "--model", "lfm2-1.2b"]) == 2
    refused = capsys.readouterr().err
    assert "sizing catalog" in refused and "hf download LiquidAI/LFM2-1.2B --local-dir LFM2-1.2B" in refused
    config = tmp_path / "ckpt" / "config.json"
    config.parent.mkdir()
    from kvserve.capacity_catalog import find_entry

    entry = find_entry("lfm2-1.2b")
    assert entry is not None
    config.write_text(json.dumps(entry.config))
    doc = run_json(capsys, "advise", "--model", str(config), "--memory", "8GiB")
    assert f"--model {config.parent} " in doc["recommendation"]["command"] and doc["recommendation"]["weights"] is None
