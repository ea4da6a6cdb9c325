"""`kvserve bench spec` end to end on a tiny checkpoint: runs, writes the documented JSON, draws a PNG, and both
engines produce the same greedy tokens. Figures are not asserted (DESIGN.md)."""

from __future__ import annotations

from bench_schema import assert_png, load_report

from kvserve.bench.spec import WORKLOADS, workload_prompts
from kvserve.cli import main

ENGINE = ["--kv-cache-memory-bytes", "8MiB", "--block-size", "4"]
POINT = {
    "workload",
    "batch_size",
    "off_decode_tok_s",
    "on_decode_tok_s",
    "off_runs",
    "on_runs",
    "speedup",
    "same_tokens",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
}


def test_bench_spec(tiny_model_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "spec.json", tmp_path / "spec.png"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "spec",
        "--model",
        str(tiny_model_dir),
        "--batch-sizes",
        "1,3",
        "--output-len",
        "12",
        "--repeats",
        "1",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        *ENGINE,
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64}',
    ]
    assert main(argv) == 0
    assert_png(out_png)
    doc = load_report(out_json, "spec")
    points = doc["results"]["points"]
    assert [(p["workload"], p["batch_size"]) for p in points] == [(w, b) for w in WORKLOADS for b in (1, 3)]
    for point in points:
        assert set(point) == POINT and point["same_tokens"]
        assert point["on_decode_tok_s"] > 0 and point["off_decode_tok_s"] > 0
    assert doc["results"]["speculative_config"]["num_speculative_tokens"] == 3
    assert sum(p["drafts"] for p in points if p["batch_size"] == 3) > 0  # the gate set above the batch
    assert "speedup@story/3" in doc["ratios"]
    assert doc["results"]["chat_template"] is False  # the char tokenizer has none: plain-text instructions
    assert "speculation off vs on" in capsys.readouterr().out


def test_workload_prompts_are_distinct_and_grounded():
    """Each workload's prompts in one batch are distinct (several sources, not one lucky prompt repeated), and the
    input-grounded ones are one user turn that carries the instruction and the whole source."""
    assert set(WORKLOADS) >= {"code-edit", "summarize", "qa", "quote", "story"}
    for name in WORKLOADS:
        prompts = workload_prompts(name, 8)
        assert len({str(p) for p in prompts}) == 8, name
    # past the sources, the instruction moves on: a big batch repeats a source with another instruction
    assert len({str(p) for p in workload_prompts("code-edit", 32)}) == 32
    assert len({str(p) for p in workload_prompts("summarize", 24)}) == 24
    edit = workload_prompts("code-edit", 1)[0]
    assert isinstance(edit, list) and edit[0]["role"] == "user"
    assert "return the whole function" in edit[0]["content"] and "def free(self, blocks" in edit[0]["content"]
    assert "Summarize" in workload_prompts("summarize", 1)[0][0]["content"]
    assert all(isinstance(p, str) for p in workload_prompts("story", 4))  # open-ended: plain continuation
