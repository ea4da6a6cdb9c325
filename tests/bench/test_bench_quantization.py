"""`kvserve bench quantization` on a tiny checkpoint: runs, writes JSON with the documented schema, and its
accuracy columns are sane (q8_0 uses fewer weight bytes; "none" agrees with itself)."""

from __future__ import annotations

import json

from kvserve.cli import main

METHOD_KEYS = {
    "quantization",
    "weight_bytes",
    "start_s",
    "perplexity",
    "perplexity_delta_perc",
    "greedy_identical_prompts",
    "greedy_first_divergence",
    "greedy_match_perc",
    "divergences_near_tie",
    "prefill_ms",
    "decode_ms_per_step",
    "decode_tokens_per_s",
}


def test_bench_quantization(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "q.json"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "quantization",
        "--model",
        str(tiny_model_dir),
        "--ppl-tokens",
        "40",
        "--greedy-prompts",
        "2",
        "--greedy-tokens",
        "4",
        "--prefill-len",
        "16",
        "--decode-batches",
        "1,3",
        "--decode-context",
        "8",
        "--decode-tokens",
        "3",
        "--repeats",
        "1",
        "--kv-cache-memory-bytes",
        "8MiB",
        "--block-size",
        "4",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == "quantization"
    none, q8 = doc["results"]["methods"]
    assert [none["quantization"], q8["quantization"]] == ["none", "q8_0"]
    assert set(none) == set(q8) == METHOD_KEYS
    assert none["greedy_identical_prompts"] == 2 and none["perplexity_delta_perc"] == 0
    assert q8["weight_bytes"] < none["weight_bytes"] / 2
    assert set(q8["decode_ms_per_step"]) == {"1", "3"}
    assert {"weight_bytes@q8_0", "ppl_delta_perc@q8_0", "prefill@q8_0", "decode@q8_0,batch1"} <= set(doc["ratios"])
    assert "q8_0" in capsys.readouterr().out


def test_method_names_set_weights_head_and_activations():
    from kvserve.bench.quantization import method_config
    from kvserve.config import EngineConfig

    base = EngineConfig(model="m")
    plain = method_config(base, "q8_0")
    assert (plain.quantization, plain.lm_head_quantization, plain.activation_quantization) == ("q8_0", None, "none")
    both = method_config(base, "gguf+lm-head-q4_0+act-int8")
    assert (both.quantization, both.lm_head_quantization, both.activation_quantization) == ("gguf", "q4_0", "int8")
    act = method_config(base, "gguf+act-int8")
    assert (act.quantization, act.lm_head_quantization, act.activation_quantization) == ("gguf", None, "int8")
