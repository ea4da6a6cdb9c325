"""`kvserve bench structured` end to end on a tiny checkpoint: every section is measured, the constrained runs
generate exactly as many tokens as the unconstrained ones (the schema cannot end early), the JSON has the
documented shape and the plot is drawn. Timings are not asserted."""

from __future__ import annotations

from bench_schema import assert_png, load_report

from kvserve.cli import main

DECODE = {
    "batch_size",
    "unconstrained_tokens_per_s",
    "constrained_tokens_per_s",
    "ratio",
    "unconstrained_runs",
    "constrained_runs",
    "unconstrained_step_ms",
    "constrained_step_ms",
}
MASK = {"batch_size", "steps", "fill_ms_per_step", "apply_ms_per_step", "mask_ms_per_step", "mask_ms_per_row"}
COMPILE = {"backend_build_s", "cold_ms", "cold_ms_runs", "cached_ms", "cached_ms_runs"}
TTFT = {
    "unconstrained_ms",
    "constrained_ms",
    "added_ms",
    "unconstrained_ms_runs",
    "constrained_ms_runs",
    "cached_path_ms",
    "cached_path_ms_runs",
}


def test_bench_structured_reports_every_section(tiny_model_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "structured.json", tmp_path / "structured.png"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "structured",
        "--model",
        str(tiny_model_dir),
        "--batch-sizes",
        "1,3",
        "--prompt-len",
        "6",
        "--output-len",
        "8",
        "--repeats",
        "2",
        "--compile-schemas",
        "2",
        "--ttft-repeats",
        "2",
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
    doc = load_report(out_json, "structured")
    results = doc["results"]
    assert set(results) == {"workload", "decode", "mask", "compile", "ttft"}
    assert [row["batch_size"] for row in results["decode"]] == [1, 3]
    assert all(set(row) == DECODE and len(row["constrained_runs"]) == 2 for row in results["decode"])
    assert all(set(row) == MASK and row["steps"] == 8 for row in results["mask"])
    assert set(results["compile"]) == COMPILE and len(results["compile"]["cold_ms_runs"]) == 2
    assert set(results["ttft"]) == TTFT
    assert set(doc["ratios"]) == {"decode_batch_1", "decode_batch_3", "ttft_constrained_over_unconstrained"}
    assert not any("ended before" in note for note in doc["notes"])  # every constrained request ran to the end
    assert "Grammar mask per decode step" in capsys.readouterr().out
